//! The timeline: one self-contained SVG of a history, to read at a glance.
//!
//! Top, the faults as bands, one lane per target, coloured by kind; the
//! `Healed` moment as a dashed line across; middle, answers per second
//! (all, and upstream answers); bottom, every answer and error as a dot at
//! (time, latency on a log scale) coloured by outcome. Dots that fall on
//! the same pixel are drawn once, and past [`MAX_DOTS`] the pixel grid
//! coarsens, so a history of any size gives a file of bounded size.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write;

use crate::check::{outcome, Outcome};
use crate::history::{Event, FaultPhase};

const WIDTH: f64 = 1200.0;
const HEIGHT: f64 = 600.0;
const LEFT: f64 = 140.0;
const RIGHT: f64 = 20.0;
const PLOT_W: f64 = WIDTH - LEFT - RIGHT;
const LANES_TOP: f64 = 44.0;
const LANES_H: f64 = 160.0;
const RATE_TOP: f64 = 218.0;
const RATE_H: f64 = 56.0;
const LAT_TOP: f64 = 290.0;
const LAT_H: f64 = 245.0;
const AXIS_Y: f64 = LAT_TOP + LAT_H;
/// Distinct dot positions drawn at most (all outcomes together).
pub(crate) const MAX_DOTS: usize = 20_000;
/// Rate bins at most across the run.
const MAX_BINS: u64 = 600;

/// Renders the history as an SVG document.
pub(crate) fn svg(events: &[Event]) -> String {
    let mut ev: Vec<&Event> = events.iter().collect();
    ev.sort_by_key(|e| e.t());
    let t_end = ev.iter().map(|e| e.t()).max().unwrap_or(0).max(1000);
    let x = |t: f64| LEFT + t / t_end as f64 * PLOT_W;

    let mut s = String::with_capacity(64 * 1024);
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11" fill="#222">"##
    );
    let _ = writeln!(
        s,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>"##
    );

    // Title.
    let title = match ev.iter().find_map(|e| match e {
        Event::Run(r) => Some(r),
        _ => None,
    }) {
        Some(r) => format!(
            "idemproxy campaign: seed {}, {}, {} proxies, {} clients, lease {} ms ({})",
            r.seed, r.topology, r.proxies, r.clients, r.lease_ms, r.lease_expiry
        ),
        None => "idemproxy campaign".to_string(),
    };
    let _ = writeln!(
        s,
        r#"<text x="10" y="16" font-size="13" font-weight="bold">{}</text>"#,
        esc(&title)
    );

    time_axis(&mut s, &x, t_end);

    faults(&mut s, &ev, &x, t_end);
    rates(&mut s, &ev, &x, t_end);
    latencies(&mut s, &ev, &x);

    // The healed moment, over everything.
    if let Some(t) = ev.iter().find_map(|e| match e {
        Event::Healed { t } => Some(*t),
        _ => None,
    }) {
        let hx = x(t as f64);
        let _ = writeln!(
            s,
            r##"<line class="healed" x1="{hx:.1}" y1="{}" x2="{hx:.1}" y2="{AXIS_Y}" stroke="#2b8a3e" stroke-width="1.5" stroke-dasharray="6 3"/>"##,
            LANES_TOP
        );
        // Beside the line, on the side with room, at the foot of the lanes.
        let (lx, anchor) = if hx > LEFT + PLOT_W * 0.85 {
            (hx - 4.0, "end")
        } else {
            (hx + 4.0, "start")
        };
        let _ = writeln!(
            s,
            r##"<text x="{lx:.1}" y="{}" text-anchor="{anchor}" fill="#2b8a3e">healed {:.1} s</text>"##,
            LANES_TOP + LANES_H - 4.0,
            t as f64 / 1000.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The time grid and axis, a tick every [`tick_step`], labelled in seconds.
fn time_axis(s: &mut String, x: &impl Fn(f64) -> f64, t_end: u64) {
    let step = tick_step(t_end);
    let _ = writeln!(s, r##"<g class="x-axis" stroke="#e6e6e6">"##);
    let mut tick = 0u64;
    while tick <= t_end {
        let tx = x(tick as f64);
        let _ = writeln!(
            s,
            r#"<line x1="{tx:.1}" y1="{LANES_TOP}" x2="{tx:.1}" y2="{AXIS_Y}"/>"#
        );
        tick += step;
    }
    s.push_str("</g>\n");
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{AXIS_Y}" x2="{}" y2="{AXIS_Y}" stroke="#444"/>"##,
        LEFT + PLOT_W
    );
    let mut tick = 0u64;
    while tick <= t_end {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x(tick as f64),
            AXIS_Y + 14.0,
            tick / 1000
        );
        tick += step;
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">time (s)</text>"#,
        LEFT + PLOT_W,
        AXIS_Y + 28.0
    );
}

/// A fault from start to end (`None`: it never healed).
struct Band<'a> {
    id: u32,
    kind: &'a str,
    target: &'a str,
    start: u64,
    end: Option<u64>,
}

fn faults(s: &mut String, ev: &[&Event], x: &impl Fn(f64) -> f64, t_end: u64) {
    let bands = fault_bands(ev);
    let lanes: BTreeMap<&str, usize> = bands
        .iter()
        .map(|b| b.target)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i))
        .collect();
    fault_legend(s, &bands);
    if lanes.is_empty() {
        return;
    }
    fault_lanes(s, &bands, &lanes, x, t_end);
}

/// The faults of the history, start paired with end by id.
fn fault_bands<'a>(ev: &[&'a Event]) -> Vec<Band<'a>> {
    let mut bands: Vec<Band> = Vec::new();
    let mut open: HashMap<u32, Vec<usize>> = HashMap::new();
    for e in ev {
        if let Event::Fault {
            t,
            id,
            kind,
            target,
            phase,
        } = e
        {
            match phase {
                FaultPhase::Start => {
                    open.entry(*id).or_default().push(bands.len());
                    bands.push(Band {
                        id: *id,
                        kind,
                        target,
                        start: *t,
                        end: None,
                    });
                }
                FaultPhase::End => {
                    if let Some(b) = open.get_mut(id).and_then(Vec::pop) {
                        bands[b].end = Some(*t);
                    }
                }
            }
        }
    }
    bands
}

/// The legend of the fault kinds present (or "none").
fn fault_legend(s: &mut String, bands: &[Band]) {
    let kinds: BTreeSet<&str> = bands.iter().map(|b| b.kind).collect();

    // Legend of kinds.
    let _ = write!(
        s,
        r#"<g class="legend-faults"><text x="10" y="34">faults{}</text>"#,
        if bands.is_empty() { ": none" } else { "" }
    );
    let mut lx = LEFT;
    for k in &kinds {
        let _ = write!(
            s,
            r#"<g class="legend-fault"><rect x="{lx:.1}" y="25" width="14" height="10" fill="{}" fill-opacity="0.5" stroke="{0}"/><text x="{:.1}" y="34">{}</text></g>"#,
            fault_colour(k),
            lx + 18.0,
            esc(k)
        );
        lx += 26.0 + 6.5 * k.len() as f64;
    }
    s.push_str("</g>\n");
}

/// A lane per fault target, and a band per fault in its lane.
fn fault_lanes(
    s: &mut String,
    bands: &[Band],
    lanes: &BTreeMap<&str, usize>,
    x: &impl Fn(f64) -> f64,
    t_end: u64,
) {
    let lane_h = (LANES_H / lanes.len() as f64).min(18.0);
    let font = (lane_h - 3.0).clamp(5.0, 11.0);
    let _ = writeln!(s, r#"<g class="lanes" font-size="{font:.1}">"#);
    for (target, &i) in lanes {
        let y = LANES_TOP + i as f64 * lane_h;
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{:.1}" x2="{}" y2="{0:.1}" stroke="#f0f0f0"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            y + lane_h,
            LEFT + PLOT_W,
            LEFT - 6.0,
            y + lane_h / 2.0 + font / 2.5,
            esc(target)
        );
    }
    s.push_str("</g>\n");
    for b in bands {
        let y = LANES_TOP + lanes[b.target] as f64 * lane_h;
        let x0 = x(b.start as f64);
        let x1 = x(b.end.unwrap_or(t_end) as f64);
        let until = match b.end {
            Some(end) => format!("{:.1} s", end as f64 / 1000.0),
            None => "never healed".to_string(),
        };
        let _ = writeln!(
            s,
            r#"<rect class="fault" x="{x0:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}" fill-opacity="0.45" stroke="{3}" stroke-opacity="0.8"><title>{} {} (fault {}): {:.1} s to {}</title></rect>"#,
            y + 1.0,
            (x1 - x0).max(1.5),
            (lane_h - 2.0).max(1.0),
            fault_colour(b.kind),
            esc(b.kind),
            esc(b.target),
            b.id,
            b.start as f64 / 1000.0,
            until
        );
    }
}

/// Answers and errors per second: all of them, and upstream answers.
fn rates(s: &mut String, ev: &[&Event], x: &impl Fn(f64) -> f64, t_end: u64) {
    let bin_ms = (t_end.div_ceil(MAX_BINS)).div_ceil(1000).max(1) * 1000;
    let bins = (t_end / bin_ms + 1) as usize;
    let mut all = vec![0u64; bins];
    let mut upstream = vec![0u64; bins];
    for e in ev {
        match e {
            Event::Answer { t, exec, .. } => {
                all[(*t / bin_ms) as usize] += 1;
                if exec.is_some() {
                    upstream[(*t / bin_ms) as usize] += 1;
                }
            }
            Event::Error { t, .. } => all[(*t / bin_ms) as usize] += 1,
            _ => {}
        }
    }
    let per_s = |n: u64| n as f64 * 1000.0 / bin_ms as f64;
    let max = all.iter().copied().max().map_or(0.0, per_s).max(1.0);
    let y = |n: u64| RATE_TOP + RATE_H - per_s(n) / max * RATE_H;
    let _ = writeln!(
        s,
        r##"<g class="rates"><line x1="{LEFT}" y1="{}" x2="{}" y2="{0}" stroke="#999"/><text x="{}" y="{}" text-anchor="end">answers/s</text><text x="{2}" y="{}" text-anchor="end" fill="#666">max {:.0}</text>"##,
        RATE_TOP + RATE_H,
        LEFT + PLOT_W,
        LEFT - 6.0,
        RATE_TOP + RATE_H / 2.0,
        RATE_TOP + RATE_H / 2.0 + 13.0,
        max
    );
    for (series, colour, label) in [
        (&all, "#444", "all answers and errors"),
        (&upstream, "#2b8a3e", "upstream answers"),
    ] {
        let mut pts = String::new();
        for (i, &n) in series.iter().enumerate() {
            let mid = ((i as u64 * bin_ms + bin_ms / 2).min(t_end)) as f64;
            let _ = write!(pts, "{:.1},{:.1} ", x(mid), y(n));
        }
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="1" points="{}"><title>{label}</title></polyline>"#,
            pts.trim_end()
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" fill="#666">— all   <tspan fill="#2b8a3e">— upstream answers</tspan></text></g>"##,
        LEFT + 4.0,
        RATE_TOP - 4.0
    );
}

/// Latency (log scale, 1 ms to 10 s+) of every answer and error by outcome.
fn latencies(s: &mut String, ev: &[&Event], x: &impl Fn(f64) -> f64) {
    latency_axis(s);
    let points: Vec<(Outcome, f64, f64)> = ev
        .iter()
        .filter_map(|e| {
            let o = outcome(e)?;
            let ms = match e {
                Event::Answer { latency_ms, .. } | Event::Error { latency_ms, .. } => *latency_ms,
                _ => return None,
            };
            Some((o, x(e.t() as f64), latency_y(ms)))
        })
        .collect();
    let drawn = latency_dots(s, &points);
    outcome_legend(s, &points, drawn);
}

/// The latency plot's y of `ms` (log scale, 1 ms to 10 s+).
fn latency_y(ms: f64) -> f64 {
    let l = ms.clamp(1.0, 10_000.0).log10() / 4.0;
    LAT_TOP + LAT_H - l * LAT_H
}

/// The latency plot's y axis: a line per decade, labelled.
fn latency_axis(s: &mut String) {
    let _ = writeln!(
        s,
        r##"<g class="y-axis" stroke="#eee"><line x1="{LEFT}" y1="{LAT_TOP}" x2="{LEFT}" y2="{AXIS_Y}" stroke="#444"/>"##
    );
    for (ms, label) in [
        (1.0, "1 ms"),
        (10.0, "10 ms"),
        (100.0, "100 ms"),
        (1000.0, "1 s"),
        (10_000.0, "10 s+"),
    ] {
        let ty = latency_y(ms);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{}" y2="{ty:.1}"/><text x="{}" y="{:.1}" text-anchor="end" stroke="none" fill="#222">{label}</text>"##,
            LEFT + PLOT_W,
            LEFT - 6.0,
            ty + 4.0
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="10" y="{:.1}" stroke="none" fill="#222">latency</text></g>"##,
        LAT_TOP + LAT_H / 2.0
    );
}

/// The points (outcome, x, y) as dots; returns how many were drawn.
fn latency_dots(s: &mut String, points: &[(Outcome, f64, f64)]) -> usize {
    // One dot per occupied cell and outcome; cells grow until few enough.
    let mut cell = 1.0;
    let cells = loop {
        let mut cells: BTreeMap<Outcome, BTreeSet<(i32, i32)>> = BTreeMap::new();
        for &(o, px, py) in points {
            cells
                .entry(o)
                .or_default()
                .insert(((px / cell) as i32, (py / cell) as i32));
        }
        if cells.values().map(BTreeSet::len).sum::<usize>() <= MAX_DOTS || cell >= 64.0 {
            break cells;
        }
        cell *= 2.0;
    };
    let drawn: usize = cells.values().map(BTreeSet::len).sum();
    // Common outcomes first, the rare and telling ones on top.
    let order = [
        Outcome::Executed,
        Outcome::Replayed,
        Outcome::Other,
        Outcome::InFlight,
        Outcome::Proxy5xx,
        Outcome::ErrorConnect,
        Outcome::ErrorTimeout,
    ];
    let width = if cell > 1.0 { cell.min(4.0) + 1.0 } else { 3.0 };
    for o in order {
        let Some(set) = cells.get(&o) else { continue };
        let mut d = String::with_capacity(set.len() * 12);
        for &(cx, cy) in set {
            let px = (cx as f64 + 0.5) * cell;
            let py = (cy as f64 + 0.5) * cell;
            let _ = write!(d, "M{px:.1} {py:.1}h0");
        }
        let _ = writeln!(
            s,
            r#"<path class="dots" data-outcome="{}" fill="none" stroke="{}" stroke-opacity="0.75" stroke-width="{width:.1}" stroke-linecap="round" d="{d}"/>"#,
            esc(o.label()),
            outcome_colour(o)
        );
    }
    drawn
}

/// The legend of the outcomes present with their counts, and how many
/// answers and errors there were and dots drawn.
fn outcome_legend(s: &mut String, points: &[(Outcome, f64, f64)], drawn: usize) {
    let mut counts: BTreeMap<Outcome, u64> = BTreeMap::new();
    for p in points {
        *counts.entry(p.0).or_default() += 1;
    }
    // Legend of outcomes present.
    let ly = HEIGHT - 18.0;
    let _ = write!(
        s,
        r#"<g class="legend-outcomes"><text x="10" y="{ly}">answers</text>"#
    );
    let mut lx = LEFT;
    for o in Outcome::ALL {
        let Some(n) = counts.get(&o) else { continue };
        let label = format!("{} {n}", o.label());
        let _ = write!(
            s,
            r#"<g class="legend-outcome"><circle cx="{:.1}" cy="{:.1}" r="4" fill="{}"/><text x="{:.1}" y="{ly}">{}</text></g>"#,
            lx + 4.0,
            ly - 4.0,
            outcome_colour(o),
            lx + 12.0,
            esc(&label)
        );
        lx += 24.0 + 6.2 * label.len() as f64;
    }
    let total = points.len();
    let note = if drawn < total {
        format!("{total} answers and errors, {drawn} dots")
    } else {
        format!("{total} answers and errors")
    };
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{ly}" text-anchor="end" fill="#666">{}</text></g>"##,
        LEFT + PLOT_W,
        esc(&note)
    );
}

/// A tick every 1, 2, 5, 10, 15, 30 s, 1, 2, 5, 10, 15, 30 min... so that
/// at most 12 ticks cover the run.
fn tick_step(t_end: u64) -> u64 {
    let steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];
    let step_s = steps
        .into_iter()
        .find(|&s| t_end / (s * 1000) <= 12)
        .unwrap_or_else(|| t_end / 12_000 + 1);
    step_s * 1000
}

fn outcome_colour(o: Outcome) -> &'static str {
    match o {
        Outcome::Executed => "#2b8a3e",
        Outcome::Replayed => "#1c7ed6",
        Outcome::InFlight => "#f08c00",
        Outcome::Proxy5xx => "#e03131",
        Outcome::ErrorTimeout => "#7048e8",
        Outcome::ErrorConnect => "#c2255c",
        Outcome::Other => "#868e96",
    }
}

fn fault_colour(kind: &str) -> &'static str {
    const PALETTE: [&str; 8] = [
        "#5c940d", "#0b7285", "#a61e4d", "#5f3dc4", "#d9480f", "#364fc7", "#087f5b", "#862e9c",
    ];
    match kind {
        "kill" => "#e03131",
        "pause" => "#f59f00",
        "failover" => "#ae3ec9",
        "partition" => "#1971c2",
        "one_way" => "#4dabf7",
        "cut" => "#495057",
        "delay" => "#0ca678",
        "loss" => "#f783ac",
        "stall" => "#f76707",
        "slow_upstream" => "#94d82d",
        other => {
            // FNV-1a: the same unknown kind, the same colour, every run.
            let h = other.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            PALETTE[(h % PALETTE.len() as u64) as usize]
        }
    }
}

/// Escapes text for XML content and attribute values.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() && c != '\n' && c != '\t' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{AtRisk, Phase, Run};

    fn run() -> Event {
        Event::Run(Run {
            topology: "redis-sentinel".into(),
            seed: 11,
            duration_ms: 60_000,
            proxies: 3,
            clients: 4,
            lease_ms: 2000,
            lease_expiry: "unknown_outcome".into(),
            wait_replicas: 1,
            at_risk: AtRisk::StoreFailover,
            settle_bound_ms: 5000,
        })
    }

    fn fault(t: u64, id: u32, kind: &str, target: &str, phase: FaultPhase) -> Event {
        Event::Fault {
            t,
            id,
            kind: kind.into(),
            target: target.into(),
            phase,
        }
    }

    fn answer(t: u64, op: u64, status: u16, exec: Option<&str>, replayed: bool, ms: f64) -> Event {
        Event::Answer {
            t,
            op,
            status,
            replayed,
            body_sha: "00".into(),
            exec: exec.map(Into::into),
            answer_key: None,
            problem: None,
            latency_ms: ms,
        }
    }

    /// A small history with every outcome and four faults on three targets.
    fn small() -> Vec<Event> {
        let mut ev = vec![run()];
        for (id, kind, target, from, to) in [
            (1, "kill", "proxy-1", 1000, 4000),
            (2, "failover", "store", 5000, 9000),
            (3, "partition", "proxy-0->store", 6000, 7000),
            (4, "kill", "proxy-1", 10_000, 12_000),
        ] {
            ev.push(fault(from, id, kind, target, FaultPhase::Start));
            ev.push(fault(to, id, kind, target, FaultPhase::End));
        }
        for op in 0..200u64 {
            let t = op * 100;
            ev.push(Event::Invoke {
                t,
                op,
                client: 0,
                key: format!("k{op}"),
                attempt: 0,
                proxy: 0,
                phase: Phase::Load,
            });
            let ms = 1.0 + (op % 7) as f64 * 300.0;
            ev.push(match op % 7 {
                0 | 1 => answer(t + 5, op, 201, Some("x"), false, ms),
                2 => answer(t + 5, op, 201, Some("x"), true, ms),
                3 => answer(t + 5, op, 409, None, false, ms),
                4 => answer(t + 5, op, 502, None, false, ms),
                5 => Event::Error {
                    t: t + 5,
                    op,
                    error: "timeout".into(),
                    latency_ms: 10_000.0,
                },
                _ => Event::Error {
                    t: t + 5,
                    op,
                    error: "connect".into(),
                    latency_ms: 0.3,
                },
            });
        }
        ev.push(Event::Healed { t: 14_000 });
        ev.push(Event::End { t: 21_000 });
        ev
    }

    /// Every element opened is closed, in order.
    fn assert_balanced(svg: &str) {
        assert!(svg.starts_with("<svg"), "{}", &svg[..60.min(svg.len())]);
        assert!(svg.trim_end().ends_with("</svg>"));
        let mut stack: Vec<&str> = Vec::new();
        let mut rest = svg;
        while let Some(i) = rest.find('<') {
            let end = rest[i..].find('>').expect("a tag ends") + i;
            let tag = &rest[i + 1..end];
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(stack.pop(), Some(name.trim()), "closing {name}");
            } else if !tag.ends_with('/') {
                let name = tag.split_whitespace().next().expect("a name");
                stack.push(name);
            }
            assert!(!tag.contains('<'), "a tag inside a tag: {tag}");
            rest = &rest[end + 1..];
        }
        assert!(stack.is_empty(), "left open: {stack:?}");
    }

    #[test]
    fn the_svg_is_balanced_with_a_band_per_fault_and_a_legend_per_outcome() {
        let svg = svg(&small());
        assert_balanced(&svg);
        assert_eq!(svg.matches(r#"class="fault""#).count(), 4);
        for lane in ["proxy-1", "store", "proxy-0-&gt;store"] {
            assert!(svg.contains(&format!(">{lane}</text>")), "{lane}");
        }
        assert_eq!(svg.matches(r#"class="legend-fault""#).count(), 3);
        // Every outcome but "other" is in the history.
        assert_eq!(svg.matches(r#"class="legend-outcome""#).count(), 6);
        for o in Outcome::ALL {
            if o != Outcome::Other {
                assert!(svg.contains(&format!(">{} ", o.label())), "{o:?}");
            }
        }
        assert!(svg.contains(r#"class="healed""#));
        assert!(svg.contains("seed 11"));
        // Self-contained: no script, no link, no font or image to fetch.
        for outside in ["<script", "href", "@import", "<image", "url("] {
            assert!(!svg.contains(outside), "{outside}");
        }
    }

    #[test]
    fn only_the_outcomes_present_get_a_legend() {
        let ev = vec![
            run(),
            answer(10, 1, 201, Some("x"), false, 5.0),
            answer(20, 2, 201, Some("x"), true, 1.0),
        ];
        let svg = svg(&ev);
        assert_balanced(&svg);
        assert_eq!(svg.matches(r#"class="legend-outcome""#).count(), 2);
        assert!(svg.contains(">executed 1<"));
        assert!(svg.contains(">replayed 1<"));
        assert!(!svg.contains(r#"class="fault""#));
        assert!(!svg.contains(r#"class="healed""#));
    }

    #[test]
    fn text_is_escaped() {
        let ev = vec![
            fault(0, 1, "kind<&>\"'", "a<b>&c", FaultPhase::Start),
            fault(500, 1, "kind<&>\"'", "a<b>&c", FaultPhase::End),
        ];
        let svg = svg(&ev);
        assert_balanced(&svg);
        assert!(svg.contains("a&lt;b&gt;&amp;c"));
        assert!(svg.contains("kind&lt;&amp;&gt;&quot;&apos;"));
        assert!(!svg.contains("a<b"));
    }

    #[test]
    fn an_empty_history_and_a_fault_never_healed_still_draw() {
        assert_balanced(&svg(&[]));
        let svg = svg(&[run(), fault(2000, 9, "pause", "store-0", FaultPhase::Start)]);
        assert_balanced(&svg);
        assert!(svg.contains("never healed"));
    }

    #[test]
    fn a_huge_history_stays_small() {
        let mut ev = small();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for op in 1000..101_000u64 {
            // A cheap deterministic scatter (xorshift).
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let t = op * 6;
            let ms = (seed % 20_000) as f64 / 3.0 + 0.5;
            ev.push(match seed % 5 {
                0 => Event::Error {
                    t,
                    op,
                    error: "timeout".into(),
                    latency_ms: ms,
                },
                1 => answer(t, op, 409, None, false, ms),
                2 => answer(t, op, 201, Some("x"), true, ms),
                _ => answer(t, op, 201, Some("x"), false, ms),
            });
        }
        let svg = svg(&ev);
        assert_balanced(&svg);
        assert!(svg.len() < 5_000_000, "{} bytes", svg.len());
        assert!(svg.len() < 1_000_000, "{} bytes", svg.len());
        assert!(svg.matches('<').count() < 1000);
        assert!(
            svg.contains("dots</text>"),
            "the note says dots were merged"
        );
    }
}
