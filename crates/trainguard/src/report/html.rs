//! The report page: header (config essentials, summary, memory tables, skipped lines), the
//! panels twice (x = optimizer step, x = wall time; radio buttons and CSS switch between them, so
//! the switch works without script), the plotted data as JSON, and a small script for a hover
//! readout that records `data-status="ok"` on `<body>` when it ran (errors go there too).
use super::read::RunData;
use super::series::{self, Mark, PanelDef, Points, GIB, PANELS};
use super::svg::{self, esc, fmt_num, HLine, Line, VMark};
use serde_json::{json, Value};
use std::fmt::Write;

const COLORS: &[&str] =
    &["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#e377c2"];
const DASHES: &[&str] = &["", "7 3", "2 2", "9 3 2 3", "4 4", "12 2"];

/// The points drawn for each run, keyed by metrics field, and its markers.
struct Drawn {
    series: Vec<(&'static str, Points)>,
    marks: Vec<(Mark, f64)>,
}

fn drawn(run: &RunData) -> Drawn {
    let series = PANELS
        .iter()
        .flat_map(|p| p.series.iter().map(move |s| (s.key, series::drawn(run, s.key, p.steps))))
        .collect();
    let marks = series::marks(run).into_iter().map(|m| {
        let wall = run.wall_at(m.step);
        (m, wall)
    });
    Drawn { series, marks: marks.collect() }
}

pub fn page(runs: &[RunData]) -> String {
    let drawn: Vec<Drawn> = runs.iter().map(drawn).collect();
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let mut o = String::new();
    let title = format!("trainguard report: {}", names.join(" vs "));
    let _ = write!(
        o,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><title>{}</title><style>{CSS}</style></head>\n<body data-status=\"loading\">\n<h1>{}</h1>\n<p class=\"gen\">trainguard {} · {}</p>\n",
        esc(&title),
        esc(&title),
        env!("CARGO_PKG_VERSION"),
        runs.iter().map(|r| esc(&r.dir.display().to_string())).collect::<Vec<_>>().join(" · ")
    );
    o.push_str("<section class=\"runs\">\n");
    for (i, r) in runs.iter().enumerate() {
        o.push_str(&header(r, (runs.len() > 1).then(|| COLORS[i % COLORS.len()])));
    }
    o.push_str("</section>\n");
    o.push_str("<input type=\"radio\" name=\"xaxis\" id=\"x-step\" checked><label for=\"x-step\">x: optimizer step</label> <input type=\"radio\" name=\"xaxis\" id=\"x-wall\"><label for=\"x-wall\">x: wall time</label>\n<div class=\"panels\">\n");
    for axis in ["step", "wall"] {
        let _ = writeln!(o, "<div class=\"by-{axis}\">");
        for p in PANELS.iter().filter(|p| shown(p, &drawn)) {
            o.push_str(&panel(p, axis, runs, &drawn));
        }
        o.push_str("</div>\n");
    }
    o.push_str("</div>\n");
    // JSON inside <script>: `<` escaped so no string can close the element.
    let data = serde_json::to_string(&data_json(runs, &drawn))
        .expect("JSON values serialise")
        .replace('<', "\\u003c");
    let _ = write!(o, "<script type=\"application/json\" id=\"trainguard-data\">{data}</script>\n<p id=\"script-status\" class=\"gen\">the hover readout needs JavaScript</p>\n<script>{SCRIPT}</script>\n</body></html>\n");
    o
}

/// The plotted numbers, exactly as in metrics.jsonl (memory in bytes), per run and field.
fn data_json(runs: &[RunData], drawn: &[Drawn]) -> Value {
    let runs: Vec<Value> = runs
        .iter()
        .zip(drawn)
        .map(|(r, d)| {
            let series: serde_json::Map<String, Value> = d
                .series
                .iter()
                .map(|(k, pts)| {
                    let col = |f: fn(&(u64, f64, f64)) -> Value| Value::Array(pts.iter().map(f).collect());
                    ((*k).to_string(), json!({"step": col(|p| json!(p.0)), "wall": col(|p| json!(p.1)), "value": col(|p| json!(p.2))}))
                })
                .collect();
            let marks: Vec<Value> = d.marks.iter().map(|(m, wall)| json!({"kind": m.kind, "step": m.step, "wall": wall, "label": m.label})).collect();
            let skipped: Vec<Value> = r.skipped.iter().map(|s| json!({"file": s.file, "line": s.line, "reason": s.reason})).collect();
            json!({"name": r.name, "dir": r.dir.display().to_string(), "series": series, "marks": marks, "skipped": skipped})
        })
        .collect();
    let panels: Vec<Value> = PANELS
        .iter()
        .filter(|p| shown(p, drawn))
        .map(|p| json!({"id": p.id, "title": p.title, "unit": p.unit, "keys": p.series.iter().map(|s| s.key).collect::<Vec<_>>(), "labels": p.series.iter().map(|s| s.label).collect::<Vec<_>>(), "scale": p.series.iter().map(|s| s.scale).collect::<Vec<_>>()}))
        .collect();
    json!({"schema": 1, "runs": runs, "panels": panels})
}

/// Whether a panel is drawn: the downstream accuracy only for runs that scored `eval.tasks`
/// (an empty panel on every other run's page would say nothing).
fn shown(p: &PanelDef, drawn: &[Drawn]) -> bool {
    p.id != "downstream"
        || drawn
            .iter()
            .any(|d| d.series.iter().any(|(k, pts)| p.series.iter().any(|s| s.key == *k) && !pts.is_empty()))
}

/// Seconds per unit and the axis label for a wall-time axis reaching `max_s`.
fn wall_unit(max_s: f64) -> (f64, &'static str) {
    if max_s > 3.0 * 3600.0 {
        (3600.0, "wall time (h)")
    } else if max_s > 180.0 {
        (60.0, "wall time (min)")
    } else {
        (1.0, "wall time (s)")
    }
}

fn panel(p: &PanelDef, axis: &str, runs: &[RunData], drawn: &[Drawn]) -> String {
    let wall = axis == "wall";
    let max_wall = drawn
        .iter()
        .flat_map(|d| {
            d.series.iter().flat_map(|s| s.1.iter().map(|q| q.1)).chain(d.marks.iter().map(|m| m.1))
        })
        .fold(0.0, f64::max);
    let (unit, x_label) = if wall { wall_unit(max_wall) } else { (1.0, "optimizer step") };
    let x_of = |step: u64, w: f64| if wall { w / unit } else { step as f64 };
    let multi = runs.len() > 1;
    let mut lines = vec![];
    let mut legend = String::new();
    for (ri, d) in drawn.iter().enumerate() {
        for (si, s) in p.series.iter().enumerate() {
            let Some((_, pts)) = d.series.iter().find(|(k, _)| *k == s.key) else { continue };
            if pts.is_empty() {
                continue;
            }
            let (color, dash) = if multi {
                (COLORS[ri % COLORS.len()], DASHES[si % DASHES.len()])
            } else {
                (COLORS[si % COLORS.len()], "")
            };
            let label = if multi { format!("{} · {}", runs[ri].name, s.label) } else { s.label.to_string() };
            let _ = write!(
                legend,
                r#"<span><svg width="26" height="10"><line x1="0" y1="5" x2="26" y2="5" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/></svg>{}</span>"#,
                esc(&label)
            );
            lines.push(Line {
                run: ri,
                key: s.key,
                color,
                dash,
                points: pts.iter().map(|q| (x_of(q.0, q.1), q.2 * s.scale)).collect(),
                staircase: p.steps,
            });
        }
    }
    let mut hlines = vec![];
    if p.id == "memory" {
        for (ri, r) in runs.iter().enumerate() {
            let who = if multi { format!("{}: ", r.name) } else { String::new() };
            let color = if multi { COLORS[ri % COLORS.len()] } else { "#555555" };
            if let Some(total) = r.series("gpu_memory_total_bytes").last() {
                hlines.push(HLine {
                    label: format!("{who}device total {:.1} GiB", total.2 / GIB),
                    y: total.2 / GIB,
                    color,
                });
            }
            let started = r.last_event("run_started");
            if let Some(limit) = started.and_then(|e| e["memory_limit_bytes"].as_f64()) {
                // On CPU the cap is on address space mapped above start-up, not on resident size.
                let cpu = started.is_some_and(|e| e["device"] == "cpu");
                let what = if cpu { " (CPU: address space above start-up)" } else { "" };
                hlines.push(HLine {
                    label: format!("{who}memory.limit {:.2} GiB{what}", limit / GIB),
                    y: limit / GIB,
                    color: "#d62728",
                });
            }
        }
    }
    let marks: Vec<VMark> = drawn
        .iter()
        .enumerate()
        .flat_map(|(ri, d)| {
            d.marks.iter().map(move |(m, w)| VMark {
                x: x_of(m.step, *w),
                step: m.step,
                kind: m.kind.clone(),
                label: if multi { format!("{}: {}", runs[ri].name, m.label) } else { m.label.clone() },
                color: series::mark_color(&m.kind),
            })
        })
        .collect();
    // One x range for every panel of an axis, so markers line up from panel to panel.
    let xs = drawn.iter().flat_map(|d| {
        d.series
            .iter()
            .flat_map(|s| s.1.iter().map(|q| x_of(q.0, q.1)))
            .chain(d.marks.iter().map(|(m, w)| x_of(m.step, *w)))
    });
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    let x = if lo.is_finite() { (lo.min(0.0), hi) } else { (0.0, 1.0) };
    let unit_label = if p.unit.is_empty() {
        String::new()
    } else {
        format!(" <span class=\"unit\">({})</span>", esc(p.unit))
    };
    // Log scale and zoom are the page script's: drag across a panel to zoom every panel of the
    // axis, double-click or "reset zoom" to see the whole run again.
    let controls = if lines.is_empty() {
        ""
    } else {
        "<span class=\"ctl\"><label><input type=\"checkbox\" class=\"logy\"> log y</label><button type=\"button\" class=\"unzoom\">reset zoom</button> drag to zoom</span>"
    };
    let body = if lines.is_empty() && hlines.is_empty() {
        "<p class=\"empty\">no data in metrics.jsonl for this panel</p>".to_string()
    } else {
        String::new()
    };
    format!(
        "<figure class=\"box\"><figcaption>{}{unit_label} <span class=\"readout\"></span></figcaption><div class=\"legend\">{legend}{controls}</div>{body}{}</figure>\n",
        esc(p.title),
        svg::render(&svg::Panel { id: p.id, axis, x_label, x_unit_s: unit, x, from_zero: p.from_zero, lines: &lines, hlines: &hlines, marks: &marks })
    )
}

/// A config value as the page shows it ([`shortened`](super::read::shortened)).
fn yaml_str(v: Option<&serde_yaml::Value>) -> Option<String> {
    let text = match v? {
        serde_yaml::Value::Null => None,
        serde_yaml::Value::String(s) => Some(s.clone()),
        serde_yaml::Value::Number(n) => Some(n.to_string()),
        serde_yaml::Value::Bool(b) => Some(b.to_string()),
        other => serde_yaml::to_string(other).ok().map(|s| s.trim().replace('\n', " ")),
    };
    text.map(|t| super::read::shortened(&t).into_owned())
}

fn json_num(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// A duration for the page: seconds, minutes, hours, days; beyond a century (a clock gone wrong,
/// a hand-edited file) said as that, not as a count of hours 20 digits long.
fn secs(s: f64) -> String {
    if s > crate::config::limits::MAX_DURATION_S {
        "more than 100 years".into()
    } else if s >= 86400.0 {
        format!("{}d{:02}h", (s / 86400.0) as u64, ((s % 86400.0) / 3600.0) as u64)
    } else if s >= 3600.0 {
        format!("{}h{:02}m", (s / 3600.0) as u64, ((s % 3600.0) / 60.0) as u64)
    } else if s >= 60.0 {
        format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else {
        format!("{s:.1}s")
    }
}

/// A mixture's sources (`tokens_seen/<name>` and `val_loss/<name>` of metrics.jsonl): the
/// tokens each gave so far with its share, and its last validation loss. Empty for one source.
fn mixture_table(r: &RunData) -> String {
    let Some(last) = r.steps.values().next_back() else { return String::new() };
    let seen: Vec<(&str, f64)> =
        last.iter().filter_map(|(k, v)| Some((k.strip_prefix("tokens_seen/")?, json_num(v)?))).collect();
    if seen.is_empty() {
        return String::new();
    }
    let total: f64 = seen.iter().map(|(_, n)| n).sum();
    let mut t = String::from("<tr><th>source</th><th>tokens</th><th>share</th><th>last val loss</th></tr>");
    for (name, n) in seen {
        let val =
            r.series(&format!("val_loss/{name}")).last().map_or("–".into(), |p| format!("{:.4}", p.2));
        let share = if total > 0.0 { 100.0 * n / total } else { 0.0 };
        let _ = write!(t, "<tr><td>{}</td><td>{n:.0}</td><td>{share:.1}%</td><td>{val}</td></tr>", esc(name));
    }
    format!("<table class=\"kv\"><caption>data mixture</caption>{t}</table>")
}

fn row(o: &mut String, k: &str, v: impl AsRef<str>) {
    let _ = write!(o, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v.as_ref()));
}

/// How the run stands: events after the last start decide.
fn status(r: &RunData) -> String {
    let start = r.events.iter().rposition(|e| e["event"] == "run_started").unwrap_or(0);
    let last_step = r.steps.keys().next_back().copied();
    for e in r.events[start.min(r.events.len())..].iter().rev() {
        match e["event"].as_str() {
            Some("run_finished") => return format!("finished: {} steps", e["steps"]),
            Some("stopped") => {
                return format!("stopped at step {}: {}", e["step"], e["reason"].as_str().unwrap_or("?"))
            }
            _ => {}
        }
    }
    match last_step {
        Some(s) => {
            format!("running, or ended without a summary (killed?): last step in metrics.jsonl is {s}")
        }
        None => "no steps in metrics.jsonl yet".into(),
    }
}

fn header(r: &RunData, color: Option<&str>) -> String {
    let mut o = String::new();
    let swatch =
        color.map(|c| format!("<span class=\"swatch\" style=\"background:{c}\"></span>")).unwrap_or_default();
    let _ = write!(
        o,
        "<div class=\"run\"><h2>{swatch}{}</h2><p class=\"status\">{}</p><div class=\"tables\">",
        esc(&r.name),
        esc(&status(r))
    );
    let started = r.last_event("run_started");
    let st = |k: &str| started.map(|e| &e[k]).filter(|v| !v.is_null());
    let cfg = |k: &str| yaml_str(r.config_value(k));

    // Config essentials.
    let mut t = String::new();
    let params = st("params").and_then(json_num).map(|p| format!("{:.2}M parameters", p / 1e6));
    let shape = match (
        cfg("model.n_layer"),
        cfg("model.n_embd"),
        cfg("model.n_head"),
        cfg("model.seq_len"),
        cfg("model.vocab_size"),
    ) {
        (Some(l), Some(e), Some(h), Some(s), Some(v)) => {
            Some(format!("{l} layers × {e} hidden, {h} heads, seq {s}, vocab {v}"))
        }
        _ => None,
    };
    row(&mut t, "model", [params, shape].into_iter().flatten().collect::<Vec<_>>().join("; "));
    let g = st("global_batch_size").map(|v| v.to_string()).or_else(|| cfg("train.global_batch_size"));
    let m = st("micro_batch_size").map(|v| v.to_string()).or_else(|| cfg("train.micro_batch_size"));
    let batch = match (g, m, st("accumulation"), st("world_size")) {
        (Some(g), Some(m), Some(a), Some(w)) => {
            match (g.parse::<usize>(), m.parse::<usize>(), a.as_u64(), w.as_u64()) {
                (Ok(g), Ok(m), Some(a), Some(w)) => {
                    crate::data::batch::describe(g, m, a as usize, w as usize)
                }
                _ => format!("global {g} · micro {m} · accumulation {a} · world {w}"),
            }
        }
        (g, m, _, _) => format!("global {} · micro {}", g.unwrap_or("?".into()), m.unwrap_or("?".into())),
    };
    let tps = st("tokens_per_step").map(|v| format!("; {v} tokens/step")).unwrap_or_default();
    row(&mut t, "batch", format!("{batch}{tps}"));
    row(&mut t, "precision", cfg("precision").unwrap_or("?".into()));
    let lr = cfg("train.lr").map(|l| format!(", lr {l}")).unwrap_or_default();
    row(&mut t, "optimizer", format!("{}{lr}", cfg("optimizer.name").unwrap_or("?".into())));
    let device = st("device")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| cfg("device"))
        .unwrap_or("?".into());
    row(&mut t, "device", device);
    if let Some(l) = cfg("memory.limit") {
        let bytes = l.parse::<f64>().map(|b| format!(" ({:.3} GiB)", b / GIB)).unwrap_or_default();
        row(&mut t, "memory.limit", format!("{l}{bytes}"));
    }
    let saver = cfg("memory.activation_checkpointing").filter(|s| s != "none");
    if let Some(s) = saver {
        row(&mut t, "activation checkpointing", s);
    }
    row(
        &mut t,
        "data",
        st("corpus")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| cfg("data.source"))
            .unwrap_or("?".into()),
    );
    row(&mut t, "max steps", cfg("train.max_steps").unwrap_or("?".into()));
    let _ = write!(o, "<table class=\"kv\"><caption>config</caption>{t}</table>");

    // Summary: the run_finished event where there is one, else what metrics.jsonl says so far.
    let mut t = String::new();
    let summary = r.last_event("run_finished");
    let sm = |k: &str| summary.map(|e| &e[k]).and_then(json_num);
    let last = r.steps.values().next_back();
    let lm = |k: &str| last.and_then(|m| m.get(k)).and_then(json_num);
    let steps = sm("steps").or_else(|| r.steps.keys().next_back().map(|s| (s + 1) as f64));
    row(&mut t, "steps", steps.map(|s| format!("{s}")).unwrap_or("0".into()));
    // + 0.0: an empty sum is -0.0, shown as "-0".
    let tokens: f64 = r.steps.values().filter_map(|m| m.get("tokens").and_then(json_num)).sum::<f64>() + 0.0;
    row(&mut t, "tokens", format!("{tokens:.0}"));
    if let Some(e) = sm("elapsed_s").or_else(|| lm("elapsed_s")) {
        row(&mut t, "time", secs(e));
    }
    if let Some(v) = sm("tokens_per_s") {
        row(&mut t, "throughput", format!("{v:.0} tokens/s"));
    }
    if let Some(v) = sm("final_loss").or_else(|| lm("loss")) {
        row(&mut t, "final loss", format!("{v:.4}"));
    }
    let val = sm("final_val_loss").or_else(|| r.series("val_loss").last().map(|p| p.2));
    if let Some(v) = val {
        row(&mut t, "final val loss", format!("{v:.4}"));
    }
    for (name, step, acc, norm) in series::downstream_last(r) {
        row(&mut t, &format!("eval {name}"), format!("acc {acc:.4}, acc_norm {norm:.4} (step {step})"));
    }
    // A resumed run's summary counts its last session; events.jsonl has every session's.
    let in_events = r.events_of("oom_recovered").count();
    let ooms = match sm("oom_recoveries") {
        Some(n) if n as usize != in_events => format!("{n} (last session); {in_events} in events.jsonl"),
        Some(n) => format!("{n}"),
        None => format!("{in_events} in events.jsonl"),
    };
    row(&mut t, "OOM recoveries", ooms);
    let rollbacks: Vec<String> = r
        .events_of("rolled_back")
        .map(|e| {
            format!("to step {} (data steps {}–{} skipped)", e["step"], e["skipped_from"], e["skipped_to"])
        })
        .collect();
    if !rollbacks.is_empty() {
        row(&mut t, "divergence rollbacks", format!("{}: {}", rollbacks.len(), rollbacks.join("; ")));
    }
    if let (Some(f), Some(c)) = (sm("final_micro_batch"), sm("configured_micro_batch")) {
        row(&mut t, "micro-batch", format!("{f} (configured {c})"));
    }
    let resumed = r.events_of("resumed").next().is_some();
    // Steps trained in other runs' directories: their metrics are there, not here.
    if let Some(lineage) =
        r.last_event("resumed").and_then(|e| e["lineage"].as_array()).filter(|l| !l.is_empty())
    {
        let runs: Vec<String> = lineage
            .iter()
            .map(|l| format!("{} (to step {})", l["checkpoint"].as_str().unwrap_or("?"), l["step"]))
            .collect();
        row(&mut t, "continues", runs.join(" → "));
    }
    let waits: Vec<f64> = r.events_of("checkpoint_waited").filter_map(|e| e["seconds"].as_f64()).collect();
    if !waits.is_empty() {
        let total: f64 = waits.iter().sum();
        row(&mut t, "waits for background checkpoints", format!("{} ({total:.2}s in all)", waits.len()));
    }
    if let Some(v) = sm("time_lost_s") {
        row(
            &mut t,
            "time lost to OOM",
            if resumed { format!("{v:.2}s (last session)") } else { format!("{v:.2}s") },
        );
    }
    if let Some(v) = sm("guard_overhead_s") {
        row(&mut t, "guard overhead", format!("{v:.3}s"));
    }
    let _ = write!(o, "<table class=\"kv\"><caption>summary</caption>{t}</table>");
    o.push_str(&mixture_table(r));

    // Memory: current (last line) and peak over the run of each field metrics.jsonl has.
    let mut t = String::new();
    let mem = PANELS.iter().find(|p| p.id == "memory").map_or(&[][..], |p| p.series);
    for s in mem {
        let pts = r.series(s.key);
        if let Some(lastp) = pts.last() {
            let peak = pts.iter().map(|p| p.2).fold(f64::NEG_INFINITY, f64::max);
            let _ = write!(
                t,
                "<tr><th>{}</th><td>{} GiB</td><td>{} GiB</td></tr>",
                esc(s.label),
                fmt_num(lastp.2 / GIB),
                fmt_num(peak / GIB)
            );
        }
    }
    for (k, label) in [
        ("peak_mapped_above_start_bytes", "mapped above start (peak)"),
        ("peak_resident_above_start_bytes", "resident above start (peak)"),
    ] {
        if let Some(v) = sm(k) {
            let _ = write!(t, "<tr><th>{}</th><td></td><td>{} GiB</td></tr>", esc(label), fmt_num(v / GIB));
        }
    }
    if !t.is_empty() {
        let _ = write!(o, "<table class=\"kv\"><caption>memory (metrics.jsonl)</caption><tr><th></th><th>last</th><th>peak</th></tr>{t}</table>");
    }
    if let Some(table) = &r.memory_table {
        let _ =
            write!(o, "<div><p class=\"cap\">memory summary (train.log)</p><pre>{}</pre></div>", esc(table));
    }
    o.push_str("</div>");
    if !r.skipped.is_empty() {
        let _ = write!(o, "<details class=\"skipped\" open><summary>{} line(s) could not be read and were skipped</summary><ul>", r.skipped.len());
        for s in r.skipped.iter().take(50) {
            let _ = write!(o, "<li>{} line {}: {}</li>", esc(&s.file), s.line, esc(&s.reason));
        }
        o.push_str("</ul></details>");
    }
    o.push_str("</div>\n");
    o
}

const CSS: &str = "body{font-family:system-ui,sans-serif;margin:16px 24px;color:#222;background:#fff}h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:8px 0 4px}\
.gen{color:#777;font-size:12px;margin:2px 0 10px}.status{margin:2px 0 6px;font-size:13px}.tables{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}\
table.kv{border-collapse:collapse;font-size:12px}table.kv caption{text-align:left;font-weight:600;padding-bottom:2px}table.kv th{text-align:left;font-weight:500;color:#555;padding:1px 10px 1px 0}table.kv td{padding:1px 10px 1px 0}\
.cap{font-weight:600;font-size:12px;margin:0 0 2px}pre{font-size:11px;margin:0;background:#f6f6f6;padding:4px 6px}.skipped{font-size:12px;color:#a33;margin-top:6px}\
.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:-1px}\
.panels{margin-top:8px}.by-wall{display:none}#x-wall:checked~.panels .by-step{display:none}#x-wall:checked~.panels .by-wall{display:block}\
label{font-size:13px;margin-right:10px}figure.box{margin:10px 0 14px;max-width:1100px}figcaption{font-weight:600;font-size:14px}.unit{font-weight:400;color:#666}\
.readout{font-weight:400;font-size:12px;color:#333;margin-left:12px}.ctl{font-size:12px;color:#666;margin-left:14px}.ctl button{font-size:11px;margin:0 6px}.legend{font-size:12px;color:#333}.legend span{margin-right:14px;white-space:nowrap}.legend svg{vertical-align:middle;margin-right:4px}\
svg.panel{width:100%;height:auto;aspect-ratio:4/1;display:block}.empty{color:#888;font-size:12px}";

/// The page's script: the hover readout (the nearest point of every curve of the panel under the
/// pointer), a log y scale per panel, and zoom (drag across a panel: every panel of that axis
/// shows the range; double-click or "reset zoom" to undo). Curves are drawn again from the data
/// block, so a zoom shows every point of the range. The URL's fragment sets a view on load:
/// `#log=loss,grad_norm&x=100-200` (panels by id; the range in the step axis' units).
const SCRIPT: &str = r#"(function () {
  var body = document.body, status = document.getElementById('script-status');
  function fail(msg) { body.setAttribute('data-status', 'error: ' + msg); if (status) status.textContent = 'script error: ' + msg; }
  window.addEventListener('error', function (e) { fail(e.message); });
  try {
    var NS = 'http://www.w3.org/2000/svg';
    var data = JSON.parse(document.getElementById('trainguard-data').textContent);
    var labels = {};
    data.panels.forEach(function (p) { p.keys.forEach(function (k, i) { labels[k] = { label: p.labels[i], scale: p.scale[i] }; }); });
    function nearest(xs, x) {
      var lo = 0, hi = xs.length - 1;
      while (hi - lo > 1) { var mid = (lo + hi) >> 1; if (xs[mid] < x) lo = mid; else hi = mid; }
      return Math.abs(xs[lo] - x) <= Math.abs(xs[hi] - x) ? lo : hi;
    }
    function fmt(v) { var a = Math.abs(v); return a !== 0 && (a < 1e-3 || a >= 1e6) ? v.toExponential(2) : String(+v.toPrecision(5)); }
    function ticks(lo, hi, n) {
      var span = hi - lo; if (!(span > 0) || !isFinite(span)) return [lo];
      var mag = Math.pow(10, Math.floor(Math.log10(span / n))), step = 10 * mag;
      [1, 2, 5, 10].some(function (m) { if (span / (m * mag) <= n) { step = m * mag; return true; } return false; });
      var out = []; for (var i = Math.ceil(lo / step); i <= Math.floor(hi / step); i++) out.push(i * step);
      return out;
    }
    function el(name, attrs, text) {
      var e = document.createElementNS(NS, name);
      for (var k in attrs) e.setAttribute(k, attrs[k]);
      if (text !== undefined) e.textContent = text;
      return e;
    }
    function xsOf(s, wall, unit) { return wall ? s.wall.map(function (w) { return w / unit; }) : s.step; }
    // Draws the panel again for its current x range and scale.
    function redraw(svg) {
      var d = svg.dataset, wall = d.axis === 'wall', unit = +d.xunit, log = d.log === '1';
      var x0 = +d.x0, x1 = +d.x1, left = +d.left, right = +d.right, top = +d.top, bottom = +d.bottom;
      var curves = [], lo = Infinity, hi = -Infinity;
      function y(v) { return log ? (v > 0 ? Math.log10(v) : NaN) : v; }
      Array.prototype.forEach.call(svg.querySelectorAll('polyline.series'), function (pl) {
        var k = pl.dataset.key, s = data.runs[+pl.dataset.run].series[k], pts = [];
        if (s) {
          var xs = xsOf(s, wall, unit);
          for (var i = 0; i < xs.length; i++) {
            var v = y(s.value[i] * labels[k].scale);
            if (xs[i] < x0 || xs[i] > x1 || !isFinite(v)) continue;
            pts.push([xs[i], v]); lo = Math.min(lo, v); hi = Math.max(hi, v);
          }
        }
        curves.push([pl, pts]);
      });
      var hlines = svg.querySelectorAll('g.hline');
      Array.prototype.forEach.call(hlines, function (g) { var v = y(+g.dataset.y); if (isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
      if (!isFinite(lo)) { lo = 0; hi = 1; }
      if (hi - lo <= 1e-12 * Math.max(Math.abs(hi), 1e-300)) { lo -= 0.5; hi += 0.5; }
      var pad = (hi - lo) * 0.05; lo -= pad; hi += pad;
      function sx(x) { return left + (x - x0) / (x1 - x0) * (right - left); }
      function sy(v) { return bottom - (v - lo) / (hi - lo) * (bottom - top); }
      Array.prototype.forEach.call(svg.querySelectorAll('circle.dot'), function (c) { c.parentNode.removeChild(c); });
      curves.forEach(function (c) {
        var pl = c[0], pts = c[1], out = [], prev = null, stairs = pl.dataset.stairs === '1';
        pts.forEach(function (p) {
          if (stairs && prev !== null) out.push(sx(p[0]).toFixed(2) + ',' + sy(prev).toFixed(2));
          out.push(sx(p[0]).toFixed(2) + ',' + sy(p[1]).toFixed(2)); prev = p[1];
        });
        pl.setAttribute('points', out.join(' '));
        if (pts.length <= 60) pts.forEach(function (p) { pl.parentNode.insertBefore(el('circle', { 'class': 'dot', cx: sx(p[0]).toFixed(2), cy: sy(p[1]).toFixed(2), r: 2.5, fill: pl.getAttribute('stroke') }), pl.nextSibling); });
      });
      Array.prototype.forEach.call(hlines, function (g) {
        var v = y(+g.dataset.y), line = g.querySelector('line'), text = g.querySelector('text');
        g.setAttribute('visibility', isFinite(v) ? 'visible' : 'hidden');
        if (!isFinite(v)) return;
        line.setAttribute('y1', sy(v).toFixed(1)); line.setAttribute('y2', sy(v).toFixed(1)); text.setAttribute('y', (sy(v) - 4).toFixed(1));
      });
      Array.prototype.forEach.call(svg.querySelectorAll('g.marker'), function (g) {
        var x = +g.dataset.x, inside = x >= x0 && x <= x1;
        g.setAttribute('visibility', inside ? 'visible' : 'hidden');
        g.querySelector('line').setAttribute('x1', sx(x).toFixed(2)); g.querySelector('line').setAttribute('x2', sx(x).toFixed(2));
        g.querySelector('path').setAttribute('d', 'M' + (sx(x) - 4).toFixed(2) + ' ' + top + ' l8 0 l-4 7 z');
      });
      // Grid and tick labels; on a log scale, ticks at powers of ten where the range holds two.
      var grid = svg.querySelector('g.grid'), tk = svg.querySelector('g.ticks'), xlabel = tk.lastChild;
      while (grid.firstChild) grid.removeChild(grid.firstChild);
      while (tk.firstChild !== xlabel) tk.removeChild(tk.firstChild);
      // [position on the drawn scale, value]: on a log scale powers of ten where two fit, else
      // round values placed by their logarithm.
      var yt = ticks(lo, hi, 5).map(function (t) { return [t, t]; });
      if (log) {
        var powers = ticks(Math.ceil(lo), Math.floor(hi), 6).filter(function (t) { return t === Math.round(t); });
        yt = powers.length >= 2 ? powers.map(function (t) { return [t, Math.pow(10, t)]; })
          : ticks(Math.pow(10, lo), Math.pow(10, hi), 5).filter(function (v) { return v > 0; }).map(function (v) { return [Math.log10(v), v]; });
      }
      ticks(x0, x1, 8).forEach(function (t) {
        grid.appendChild(el('line', { x1: sx(t).toFixed(1), y1: top, x2: sx(t).toFixed(1), y2: bottom }));
        tk.insertBefore(el('text', { x: sx(t).toFixed(1), y: bottom + 14, 'text-anchor': 'middle' }, fmt(t)), xlabel);
      });
      yt.forEach(function (t) {
        grid.appendChild(el('line', { x1: left, y1: sy(t[0]).toFixed(1), x2: right, y2: sy(t[0]).toFixed(1) }));
        tk.insertBefore(el('text', { 'class': 'ytick', x: left - 5, y: sy(t[0]).toFixed(1), 'text-anchor': 'end', 'dominant-baseline': 'middle' }, fmt(t[1])), xlabel);
      });
    }
    var svgs = document.querySelectorAll('svg.panel');
    function sameAxis(axis) { return Array.prototype.filter.call(svgs, function (s) { return s.dataset.axis === axis; }); }
    function zoom(axis, x0, x1) {
      sameAxis(axis).forEach(function (s) { s.dataset.x0 = x0; s.dataset.x1 = x1; redraw(s); });
    }
    function unzoom(axis) { sameAxis(axis).forEach(function (s) { s.dataset.x0 = s.dataset.bx0; s.dataset.x1 = s.dataset.bx1; redraw(s); }); }
    Array.prototype.forEach.call(svgs, function (svg) {
      var d = svg.dataset, keys = d.keys ? d.keys.split(' ') : [], wall = d.axis === 'wall';
      var left = +d.left, right = +d.right, unit = +d.xunit, width = svg.viewBox.baseVal.width;
      d.bx0 = d.x0; d.bx1 = d.x1;
      var guide = svg.querySelector('line.guide'), fig = svg.parentNode, out = fig.querySelector('.readout');
      var sel = el('rect', { 'class': 'sel', y: d.top, height: +d.bottom - +d.top, fill: '#1f77b4', 'fill-opacity': 0.12, visibility: 'hidden' });
      svg.appendChild(sel);
      function vxOf(ev) { var box = svg.getBoundingClientRect(); return (ev.clientX - box.left) / box.width * width; }
      function xOf(vx) { return +d.x0 + (vx - left) / (right - left) * (+d.x1 - +d.x0); }
      var from = null;
      svg.addEventListener('mousedown', function (ev) { var vx = vxOf(ev); if (vx >= left && vx <= right) { from = vx; ev.preventDefault(); } });
      svg.addEventListener('mouseup', function (ev) {
        if (from === null) return;
        var to = Math.max(left, Math.min(right, vxOf(ev))), a = Math.min(from, to), b = Math.max(from, to);
        from = null; sel.setAttribute('visibility', 'hidden');
        if (b - a > 4) zoom(d.axis, xOf(a), xOf(b));
      });
      svg.addEventListener('dblclick', function () { unzoom(d.axis); });
      svg.addEventListener('mousemove', function (ev) {
        var vx = vxOf(ev);
        if (vx < left || vx > right) return;
        if (from !== null) { sel.setAttribute('x', Math.min(from, vx)); sel.setAttribute('width', Math.abs(vx - from)); sel.setAttribute('visibility', 'visible'); }
        var x = xOf(vx);
        guide.setAttribute('x1', vx); guide.setAttribute('x2', vx); guide.setAttribute('visibility', 'visible');
        var parts = [(wall ? 't ' + fmt(x) : 'step ' + Math.round(x))];
        data.runs.forEach(function (run) {
          keys.forEach(function (k) {
            var s = run.series[k];
            if (!s || !s.value.length) return;
            var i = nearest(xsOf(s, wall, unit), x), who = data.runs.length > 1 ? run.name + ' · ' : '';
            parts.push(who + labels[k].label + ' ' + fmt(s.value[i] * labels[k].scale) + ' (step ' + s.step[i] + ')');
          });
        });
        out.textContent = parts.join('  |  ');
      });
      svg.addEventListener('mouseleave', function () { guide.setAttribute('visibility', 'hidden'); from = null; sel.setAttribute('visibility', 'hidden'); });
      var logy = fig.querySelector('input.logy'), reset = fig.querySelector('button.unzoom');
      if (logy) logy.addEventListener('change', function () { d.log = logy.checked ? '1' : '0'; redraw(svg); });
      if (reset) reset.addEventListener('click', function () { unzoom(d.axis); });
    });
    // A view from the URL: #log=loss,grad_norm&x=100-200.
    var view = {};
    location.hash.replace(/^#/, '').split('&').forEach(function (kv) { var p = kv.split('='); if (p.length === 2) view[p[0]] = decodeURIComponent(p[1]); });
    if (view.log) view.log.split(',').forEach(function (id) {
      Array.prototype.forEach.call(svgs, function (s) {
        if (s.dataset.panel !== id) return;
        s.dataset.log = '1'; var box = s.parentNode.querySelector('input.logy'); if (box) box.checked = true; redraw(s);
      });
    });
    var range = (view.x || '').split('-').map(Number);
    if (range.length === 2 && range[1] > range[0]) zoom('step', range[0], range[1]);
    // For tests and tools, not the reader: the page says nothing when all is well.
    body.setAttribute('data-panels', svgs.length + ' panels, ' + data.runs.length + ' run(s)');
    status.parentNode.removeChild(status);
    body.setAttribute('data-status', 'ok');
  } catch (e) { fail(String(e)); }
})();"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_their_largest_unit_and_an_absurd_one_is_said_so() {
        assert_eq!(secs(42.0), "42.0s");
        assert_eq!(secs(7260.0), "2h01m");
        assert_eq!(secs(3.0 * 86400.0 + 5.0 * 3600.0 + 59.0), "3d05h");
        // u64::MAX seconds (a metrics line edited by hand) was "18446744073709551615h00m".
        assert_eq!(secs(u64::MAX as f64), "more than 100 years");
    }

    /// The header counts the divergence guard's rollbacks with the data each skipped.
    #[test]
    fn rollbacks_and_their_skipped_data_are_in_the_header() {
        let rolled = |step: u64, from: u64, to: u64| serde_json::json!({"event": "rolled_back", "step": step, "diverged_step": to, "skipped_from": from, "skipped_to": to});
        let r = RunData { events: vec![rolled(30, 31, 32), rolled(40, 41, 45)], ..RunData::default() };
        let h = header(&r, None);
        assert!(
            h.contains("<th>divergence rollbacks</th><td>2: to step 30 (data steps 31–32 skipped); to step 40 (data steps 41–45 skipped)</td>"),
            "{h}"
        );
        assert!(!header(&RunData::default(), None).contains("divergence"));
    }
}
