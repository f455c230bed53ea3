//! Which workloads of the input to inject: `--only KIND/NAME` and `--selector LABEL=VALUE`.

use serde_norway::{Mapping, Value};

/// The workloads chosen on the command line; empty chooses every workload.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    only: Vec<Only>,
    selector: Vec<(String, String)>,
}

/// One `--only`: a workload kind (canonical) and a name.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Only {
    kind: &'static str,
    name: String,
    text: String,
}

/// The kinds `inject` injects, with the short names kubectl knows them by.
const KINDS: [(&str, &[&str]); 7] = [
    ("Deployment", &["deployment", "deployments", "deploy"]),
    ("StatefulSet", &["statefulset", "statefulsets", "sts"]),
    ("DaemonSet", &["daemonset", "daemonsets", "ds"]),
    ("ReplicaSet", &["replicaset", "replicasets", "rs"]),
    ("Job", &["job", "jobs"]),
    ("CronJob", &["cronjob", "cronjobs", "cj"]),
    ("Pod", &["pod", "pods", "po"]),
];

impl Selection {
    /// Parses `--only` values (`KIND/NAME`) and `--selector` values
    /// (`LABEL=VALUE[,LABEL=VALUE...]`; every pair must match).
    pub fn parse(only: &[String], selector: &[String]) -> Result<Selection, String> {
        let mut s = Selection::default();
        for text in only {
            let (kind, name) = text
                .split_once('/')
                .filter(|(k, n)| !k.is_empty() && !n.is_empty() && !n.contains('/'))
                .ok_or_else(|| {
                    format!("--only {text:?}: expected KIND/NAME, e.g. deployment/api")
                })?;
            let lower = kind.to_ascii_lowercase();
            let kind = KINDS
                .iter()
                .find(|(canon, aliases)| {
                    canon.eq_ignore_ascii_case(kind) || aliases.contains(&lower.as_str())
                })
                .map(|(canon, _)| *canon)
                .ok_or_else(|| {
                    format!(
                        "--only {text:?}: {kind:?} is not a kind inject injects (Deployment, \
                         StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, Pod)"
                    )
                })?;
            s.only.push(Only {
                kind,
                name: name.to_owned(),
                text: text.clone(),
            });
        }
        for text in selector {
            for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (k, v) = pair
                    .split_once("==")
                    .or_else(|| pair.split_once('='))
                    .filter(|(k, _)| !k.trim().is_empty() && !k.ends_with('!'))
                    .ok_or_else(|| {
                        format!("--selector {text:?}: expected LABEL=VALUE[,LABEL=VALUE...]")
                    })?;
                s.selector.push((k.trim().to_owned(), v.trim().to_owned()));
            }
        }
        Ok(s)
    }

    /// Whether anything was asked for (without it, every workload is chosen).
    pub fn is_some(&self) -> bool {
        !self.only.is_empty() || !self.selector.is_empty()
    }

    /// Whether a workload is chosen: it matches one `--only` (when any is
    /// given) and every `--selector` pair, on its own labels or its pods'.
    pub(crate) fn admits(
        &self,
        kind: &str,
        name: Option<&str>,
        labels: Option<&Mapping>,
        pod_labels: Option<&Mapping>,
    ) -> bool {
        let named = self.only.is_empty()
            || self
                .only
                .iter()
                .any(|o| o.kind == kind && Some(o.name.as_str()) == name);
        let label = |k: &str| {
            [labels, pod_labels]
                .into_iter()
                .flatten()
                .find_map(|m| m.get(k).and_then(Value::as_str))
        };
        named
            && self
                .selector
                .iter()
                .all(|(k, v)| label(k) == Some(v.as_str()))
    }

    /// The `--only` values that name no workload of the input, given the
    /// (kind, name) of every workload in it.
    pub(crate) fn unmatched(&self, workloads: &[(String, Option<String>)]) -> Vec<String> {
        self.only
            .iter()
            .filter(|o| {
                !workloads
                    .iter()
                    .any(|(k, n)| k == o.kind && n.as_deref() == Some(o.name.as_str()))
            })
            .map(|o| o.text.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Mapping {
        pairs
            .iter()
            .map(|(k, v)| (Value::from(*k), Value::from(*v)))
            .collect()
    }

    #[test]
    fn only_takes_kubectls_kind_names() {
        let s = Selection::parse(&["deploy/api".into(), "StatefulSet/db".into()], &[]).unwrap();
        assert!(s.admits("Deployment", Some("api"), None, None));
        assert!(s.admits("StatefulSet", Some("db"), None, None));
        assert!(!s.admits("Deployment", Some("db"), None, None));
        assert!(!s.admits("DaemonSet", Some("api"), None, None));
        for bad in ["api", "/api", "deploy/", "service/api", "deploy/ns/api"] {
            assert!(Selection::parse(&[bad.into()], &[]).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_selector_must_match_every_pair_on_the_workload_or_its_pods() {
        let s = Selection::parse(&[], &["app=shop,tier==web".into()]).unwrap();
        let own = labels(&[("app", "shop")]);
        let pods = labels(&[("tier", "web")]);
        assert!(s.admits("Deployment", Some("x"), Some(&own), Some(&pods)));
        assert!(!s.admits("Deployment", Some("x"), Some(&own), None));
        assert!(Selection::parse(&[], &["app!=shop".into()]).is_err());
        assert!(Selection::parse(&[], &["=x".into()]).is_err());
    }

    #[test]
    fn an_only_that_names_nothing_is_reported() {
        let s = Selection::parse(&["deploy/api".into(), "deploy/typo".into()], &[]).unwrap();
        let have = vec![("Deployment".to_string(), Some("api".to_string()))];
        assert_eq!(s.unmatched(&have), vec!["deploy/typo".to_string()]);
    }
}
