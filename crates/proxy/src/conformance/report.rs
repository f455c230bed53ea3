//! What a run found, row by row: a Markdown table for people and a JSON document for programs.

use std::fmt;

use serde::Serialize;

use super::checks::Check;
pub(crate) use super::checks::Level;

/// What a row's check found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finding {
    Pass,
    Fail,
    /// The run could not show it either way (the reason is in the evidence):
    /// neither a pass nor a failure.
    NotObserved,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Finding::Pass => "pass",
            Finding::Fail => "FAIL",
            Finding::NotObserved => "not observed",
        })
    }
}

/// One row of the table.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub id: &'static str,
    pub level: Level,
    /// What the row requires, in one line.
    pub requirement: &'static str,
    pub result: Finding,
    /// What was seen: statuses, timings, counts; for "not observed", why.
    pub evidence: String,
    /// Executions were judged from the answers alone (no `--executions`):
    /// an endpoint whose answers depend only on the key would get the same
    /// result while running every request.
    pub by_answers: bool,
}

impl Row {
    pub fn new(check: &Check, result: Finding, evidence: impl Into<String>) -> Row {
        Row {
            id: check.id,
            level: check.level,
            requirement: check.requirement,
            result,
            evidence: evidence.into(),
            by_answers: false,
        }
    }

    /// The row, marked as judged from the answers alone.
    pub fn by_answers(mut self) -> Row {
        self.by_answers = true;
        self
    }
}

/// A whole run: what was driven, and the rows.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub tool: &'static str,
    pub version: &'static str,
    pub target: String,
    pub method: String,
    /// The `--executions` counter, when one was given.
    pub executions: Option<String>,
    pub rows: Vec<Row>,
    pub summary: Summary,
    /// 0: every MUST row met (or not observed); 1: a MUST row failed;
    /// 2: no MUST row could be observed (the endpoint could not be exercised).
    pub exit_code: u8,
}

/// Rows counted by level and result.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub must_failed: usize,
    pub must_not_observed: usize,
    pub should_failed: usize,
    pub practice_failed: usize,
    pub passed: usize,
    pub not_observed: usize,
}

impl Report {
    pub fn new(target: String, method: String, executions: Option<String>, rows: Vec<Row>) -> Self {
        let mut summary = Summary::default();
        for row in &rows {
            match (&row.result, row.level) {
                (Finding::Pass, _) => summary.passed += 1,
                (Finding::Fail, Level::Must) => summary.must_failed += 1,
                (Finding::Fail, Level::Should) => summary.should_failed += 1,
                (Finding::Fail, Level::Practice) => summary.practice_failed += 1,
                (Finding::NotObserved, level) => {
                    summary.not_observed += 1;
                    if level == Level::Must {
                        summary.must_not_observed += 1;
                    }
                }
            }
        }
        let musts = rows.iter().filter(|r| r.level == Level::Must).count();
        let exit_code = if summary.must_failed > 0 {
            1
        } else if musts > 0 && summary.must_not_observed == musts {
            2
        } else {
            0
        };
        Report {
            tool: "idemproxy conformance",
            version: env!("CARGO_PKG_VERSION"),
            target,
            method,
            executions,
            rows,
            summary,
            exit_code,
        }
    }

    /// The rows as a Markdown table, then one line of totals.
    pub fn table(&self) -> String {
        let mut out = String::from("| id | level | requirement | result | evidence |\n");
        out.push_str("|---|---|---|---|---|\n");
        for row in &self.rows {
            let mut result = match row.result {
                Finding::Fail => "**FAIL**".to_string(),
                ref r => r.to_string(),
            };
            if row.by_answers {
                result.push_str(" (by answers)");
            }
            out.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                row.id,
                row.level,
                cell(row.requirement),
                result,
                cell(&row.evidence)
            ));
        }
        out.push('\n');
        out.push_str(&self.verdict());
        out.push('\n');
        if self.executions.is_none() {
            out.push_str(BY_ANSWERS);
            out.push('\n');
        }
        out
    }

    /// One line: what the exit code says, and what the run could not show.
    pub fn verdict(&self) -> String {
        let s = &self.summary;
        let head = if s.must_failed > 0 {
            format!("{} MUST row(s) failed (exit 1)", s.must_failed)
        } else if self.exit_code == 2 {
            "no MUST row could be observed: the endpoint could not be exercised (exit 2)"
                .to_string()
        } else {
            "every MUST row observed was met (exit 0)".to_string()
        };
        let mut line = format!(
            "{head}; {} passed, {} SHOULD and {} PRACTICE row(s) failed, {} not observed.",
            s.passed, s.should_failed, s.practice_failed, s.not_observed
        );
        if s.must_not_observed > 0 {
            line.push_str(&format!(
                " {} MUST row(s) were not observed: this run shows no violation of them, and no \
                 conformance either.",
                s.must_not_observed
            ));
        }
        line
    }
}

/// The last line of a run without `--executions`.
const BY_ANSWERS: &str = "No --executions: executions were judged from the answers alone (rows \
     marked \"by answers\"), which an endpoint that runs every request but answers by the key \
     alone also passes; give --executions URL (a count of the operation's runs) to count them.";

/// Text made safe for a Markdown table cell: no line breaks, `|` escaped.
fn cell(text: &str) -> String {
    text.replace('\n', " ").replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::checks;

    #[test]
    fn a_failed_must_row_is_exit_1_and_the_rest_exit_0() {
        let rows = vec![
            Row::new(&checks::RETRY_RUNS_ONCE, Finding::Pass, "+0"),
            Row::new(&checks::REUSE_422, Finding::Fail, "200"),
            Row::new(&checks::IN_FLIGHT_409, Finding::NotObserved, "too fast"),
        ];
        let report = Report::new("http://x/".into(), "POST".into(), None, rows.clone());
        assert_eq!(report.exit_code, 0);
        assert_eq!(report.summary.should_failed, 1);
        assert_eq!(report.summary.not_observed, 1);
        let mut failing = rows;
        failing.push(Row::new(&checks::REUSE_REFUSED, Finding::Fail, "replayed"));
        let report = Report::new("http://x/".into(), "POST".into(), None, failing);
        assert_eq!(report.exit_code, 1);
        assert!(report.table().contains("| `reuse-refused` | MUST |"));
        assert!(report.verdict().contains("1 MUST row(s) failed (exit 1)"));
    }

    #[test]
    fn no_must_row_observed_is_exit_2() {
        let rows: Vec<Row> = checks::ALL
            .iter()
            .map(|c| Row::new(c, Finding::NotObserved, "no answer"))
            .collect();
        let report = Report::new("http://x/".into(), "POST".into(), None, rows);
        assert_eq!(report.exit_code, 2);
        assert!(
            report.verdict().contains("(exit 2)"),
            "{}",
            report.verdict()
        );
        assert!(report.table().contains("give --executions URL"));
    }

    #[test]
    fn rows_judged_by_answers_say_so() {
        let rows = vec![Row::new(&checks::RETRY_RUNS_ONCE, Finding::Pass, "same").by_answers()];
        let report = Report::new("http://x/".into(), "POST".into(), None, rows);
        assert!(report.table().contains("| pass (by answers) |"));
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["rows"][0]["by_answers"], true);
        let counted = Report::new(
            "http://x/".into(),
            "POST".into(),
            Some("http://c/".into()),
            vec![],
        );
        assert!(!counted.table().contains("give --executions"));
    }

    #[test]
    fn cells_keep_the_table_whole() {
        assert_eq!(cell("a|b\nc"), "a\\|b c");
    }
}
