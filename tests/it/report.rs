//! `trainguard report` and `metrics.tensorboard` on the real binary: the page's numbers are
//! metrics.jsonl's (in its JSON and in its SVG coordinates), events of a real OOM / regrow /
//! stop / resume run are marked on every panel, bad input is survived, runs overlay, a 100k-step
//! run stays small, Chromium renders the page without script errors, and TensorBoard's own
//! reader gets metrics.jsonl's scalars back.
use crate::common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn report(args: &[&Path]) -> std::process::Output {
    Command::new(bin()).arg("report").args(args).output().expect("run trainguard report")
}

fn report_ok(args: &[&Path]) -> String {
    let out = report(args);
    assert_eq!(out.status.code(), Some(0), "report failed: {}", String::from_utf8_lossy(&out.stderr));
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read the page {path}: {e}"))
}

/// The JSON data block the page embeds.
fn data(html: &str) -> Value {
    let start =
        html.find(r#"<script type="application/json" id="trainguard-data">"#).expect("data block") + 53;
    let end = start + html[start..].find("</script>").unwrap();
    serde_json::from_str(&html[start..end]).expect("data block is JSON")
}

/// The `<svg>` element with this id, whole.
fn svg<'a>(html: &'a str, id: &str) -> &'a str {
    let start =
        html.find(&format!(r#"<svg class="panel" id="{id}""#)).unwrap_or_else(|| panic!("no svg {id}"));
    let end = start + html[start..].find("</svg>").unwrap();
    &html[start..end]
}

fn attr(tag: &str, name: &str) -> String {
    let key = format!(" {name}=\"");
    let s =
        tag.find(&key).unwrap_or_else(|| panic!("no {name} in {}", &tag[..tag.len().min(300)])) + key.len();
    tag[s..s + tag[s..].find('"').unwrap()].to_string()
}

fn num(tag: &str, name: &str) -> f64 {
    attr(tag, name).parse().unwrap()
}

fn polyline<'a>(svg: &'a str, run: usize, key: &str) -> Option<&'a str> {
    let start = svg.find(&format!(r#"<polyline class="series" data-run="{run}" data-key="{key}""#))?;
    Some(&svg[start..start + svg[start..].find("/>").unwrap()])
}

/// The polyline's vertices mapped back through the axis domain to (x, y) data units.
fn unmapped(svg: &str, run: usize, key: &str) -> Vec<(f64, f64)> {
    let line = polyline(svg, run, key).unwrap_or_else(|| panic!("no polyline {key}"));
    let (x0, x1, y0, y1) =
        (num(svg, "data-x0"), num(svg, "data-x1"), num(svg, "data-y0"), num(svg, "data-y1"));
    let (l, r, t, b) =
        (num(svg, "data-left"), num(svg, "data-right"), num(svg, "data-top"), num(svg, "data-bottom"));
    attr(line, "points")
        .split(' ')
        .map(|p| {
            let (px, py) = p.split_once(',').unwrap();
            let (px, py): (f64, f64) = (px.parse().unwrap(), py.parse().unwrap());
            (x0 + (px - l) / (r - l) * (x1 - x0), y0 + (b - py) / (b - t) * (y1 - y0))
        })
        .collect()
}

/// A step line's points: the first, every change, the last.
fn staircase(points: &[(u64, f64)]) -> Vec<(u64, f64)> {
    let mut out: Vec<(u64, f64)> = vec![];
    for (i, p) in points.iter().enumerate() {
        if out.last().is_none_or(|l| l.1 != p.1) || i + 1 == points.len() {
            out.push(*p);
        }
    }
    out
}

/// (step, value) of a metrics field, nulls left out.
fn field(metrics: &[Value], key: &str) -> Vec<(u64, f64)> {
    metrics.iter().filter_map(|m| Some((m["step"].as_u64()?, m[key].as_f64()?))).collect()
}

fn page_series(d: &Value, run: usize, key: &str) -> Vec<(u64, f64)> {
    let s = &d["runs"][run]["series"][key];
    let steps = s["step"].as_array().unwrap();
    steps
        .iter()
        .zip(s["value"].as_array().unwrap())
        .map(|(a, b)| (a.as_u64().unwrap(), b.as_f64().unwrap()))
        .collect()
}

fn short_run(dir: &Path, extra: &[&str]) -> Run {
    let sets = [
        &["train.max_steps=12", "train.warmup_steps=2", "train.eval_interval=5", "checkpoint.interval=5"][..],
        extra,
    ]
    .concat();
    train(dir, "configs/debug.yaml", &sets).ok()
}

#[test]
fn the_numbers_drawn_are_the_numbers_in_metrics_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let run = short_run(dir.path(), &[]);
    let html = report_ok(&[dir.path()]);
    assert!(dir.path().join("report.html").is_file(), "default output is RUN_DIR/report.html");
    let d = data(&html);
    let metrics = run.metrics();
    for key in ["loss", "val_loss", "lr", "tokens_per_s", "rss_bytes", "micro_batch", "accumulation"] {
        let mut want = field(&metrics, key);
        if key == "micro_batch" || key == "accumulation" {
            want = staircase(&want);
        }
        assert!(!want.is_empty(), "{key} absent from metrics.jsonl");
        assert_eq!(page_series(&d, 0, key), want, "{key}: page data differs from metrics.jsonl");
    }
    // The SVG draws those values: vertices map back to (step, value) within rounding (2 decimals
    // of a 960-unit-wide plot).
    for (id, key) in [("loss-step", "loss"), ("throughput-step", "tokens_per_s"), ("lr-step", "lr")] {
        let s = svg(&html, id);
        let (xr, yr) = (num(s, "data-x1") - num(s, "data-x0"), num(s, "data-y1") - num(s, "data-y0"));
        let drawn = unmapped(s, 0, key);
        let want = field(&metrics, key);
        assert_eq!(drawn.len(), want.len(), "{id}: one vertex per step");
        for ((x, y), (step, v)) in drawn.iter().zip(&want) {
            assert!(
                (x - *step as f64).abs() < xr * 1e-4 && (y - v).abs() < yr * 1e-3,
                "{id}: vertex ({x}, {y}) is not step {step} value {v}"
            );
        }
    }
    // Wall-time axis: x is elapsed_s in the axis unit.
    let s = svg(&html, "loss-wall");
    let unit = num(s, "data-xunit");
    let xr = num(s, "data-x1") - num(s, "data-x0");
    let elapsed = field(&metrics, "elapsed_s");
    for ((x, _), (_, e)) in unmapped(s, 0, "loss").iter().zip(&elapsed) {
        assert!((x - e / unit).abs() < xr * 1e-4, "wall x {x} vs elapsed {e}");
    }
    // Header: config essentials and the summary.
    let summary = run.summary();
    for text in [
        "2 layers × 64 hidden",
        "adamw",
        "fp32",
        "global 32 = micro 8 × accumulation 4 × world 1",
        "finished: 12 steps",
    ] {
        assert!(html.contains(text), "header lacks {text:?}");
    }
    assert!(
        html.contains(&format!("{:.4}", summary["final_loss"].as_f64().unwrap())),
        "final loss in the summary"
    );
    assert!(html.contains("memory summary (train.log)"), "memory summary table from train.log");
}

/// A cap between the address-space peaks of micro-batch 16 and 32 (as tests/it/oom.rs calibrates).
fn cap_fitting_16() -> String {
    let peak = |micro: usize| {
        let dir = tempfile::tempdir().unwrap();
        let m = format!("train.micro_batch_size={micro}");
        let r = train(
            dir.path(),
            "configs/debug.yaml",
            &[
                "train.global_batch_size=64",
                "train.warmup_steps=0",
                "train.eval_interval=0",
                "train.max_steps=2",
                &m,
                "memory.limit=1TiB",
            ],
        )
        .ok();
        r.summary()["peak_mapped_above_start_bytes"].as_u64().unwrap()
    };
    let (p16, p32) = (peak(16), peak(32));
    assert!(p32 > p16 + (4 << 20), "micro-batch 32 should need clearly more than 16: {p16} vs {p32}");
    format!("memory.limit={}", (p16 + p32) / 2)
}

#[test]
fn events_of_a_real_oom_stop_and_resume_run_are_marked_on_every_panel() {
    let cap = cap_fitting_16();
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.global_batch_size=64",
        "train.micro_batch_size=32",
        "train.warmup_steps=0",
        "train.eval_interval=0",
        "train.max_steps=12",
        "oom.regrow_after_steps=3",
        "checkpoint.interval=4",
        "faults.nonfinite_loss_at_steps=[3]",
        &cap,
    ];
    let first =
        train(dir.path(), "configs/debug.yaml", &[&sets[..], &["faults.interrupt_at_step=7"]].concat());
    assert_eq!(first.code(), 4, "{}", first.stderr());
    let mut cmd = command(dir.path(), "configs/debug.yaml", &sets);
    cmd.args(["--resume", "auto"]);
    let run = run(cmd, dir.path()).ok();
    let events = run.events();
    let kinds = |k: &str| events.iter().filter(|e| e["event"] == k).count();
    for k in [
        "oom_recovered",
        "regrow_attempt",
        "checkpoint_saved",
        "nonfinite_skipped",
        "stopped",
        "resumed",
        "run_finished",
    ] {
        assert!(kinds(k) > 0, "the run should have a {k} event: {events:?}");
    }

    let html = report_ok(&[dir.path()]);
    let d = data(&html);
    // One continuous curve over the resume: every step once, as metrics.jsonl has it.
    let loss = page_series(&d, 0, "loss");
    assert_eq!(
        loss.iter().map(|p| p.0).collect::<Vec<_>>(),
        (1..=12).filter(|s| *s != 3).collect::<Vec<_>>(),
        "non-finite step 3 has a null loss"
    );
    assert_eq!(loss, field(&run.metrics(), "loss"));
    // The micro-batch staircase follows metrics.jsonl (the step-0 OOM settled at 16 before the
    // first line, regrow trials moved it since); the header says what was configured.
    assert_eq!(page_series(&d, 0, "micro_batch"), staircase(&field(&run.metrics(), "micro_batch")));
    let last = run.summary()["final_micro_batch"].as_u64().unwrap();
    assert!(html.contains(&format!("{last} (configured 32)")), "summary micro-batch");

    let panels = ["loss", "lr", "throughput", "memory", "batch"];
    for e in &events {
        let kind = e["event"].as_str().unwrap();
        let step = if kind == "run_finished" { e["steps"].as_u64() } else { e["step"].as_u64() };
        let (Some(step), false) =
            (step, ["run_started", "checkpoint_skipped", "loss_scale_changed"].contains(&kind))
        else {
            continue;
        };
        for p in panels {
            for axis in ["step", "wall"] {
                let s = svg(&html, &format!("{p}-{axis}"));
                let tag = format!(r#"<g class="marker" data-kind="{kind}" data-step="{step}" "#);
                assert!(s.contains(&tag), "{p}-{axis} lacks the {kind} marker at step {step}");
            }
        }
    }
    // Labels say what changed.
    let oom = events.iter().find(|e| e["event"] == "oom_recovered" && e["regrow_backoff"] == false).unwrap();
    assert!(html.contains("OOM recovered"), "OOM label");
    let change = format!(
        "micro-batch {} → {}, accumulation {} → {}",
        oom["old_micro_batch"], oom["new_micro_batch"], oom["old_accumulation"], oom["new_accumulation"]
    );
    assert!(html.contains(&change), "OOM label should contain {change:?}");
    let regrow = events.iter().find(|e| e["event"] == "regrow_attempt").unwrap();
    assert!(html.contains(&format!(
        "regrow trial: micro-batch {} → {}",
        regrow["from_micro_batch"], regrow["to_micro_batch"]
    )));
    let stopped = events.iter().find(|e| e["event"] == "stopped").unwrap();
    assert!(html.contains(&format!("stopped: {}", stopped["reason"].as_str().unwrap())), "stop reason");
    assert!(html.contains("memory.limit "), "the cap is drawn on the memory panel");
}

#[test]
fn truncated_and_garbled_lines_are_skipped_and_named_and_a_later_line_wins() {
    let dir = tempfile::tempdir().unwrap();
    let run = short_run(dir.path(), &[]);
    let mut metrics = run.metrics();
    let path = dir.path().join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&path).unwrap();
    let lines_before = text.lines().count();
    // A repeated step (a resumed run recomputing it): the later line wins.
    let mut again = metrics[3].clone();
    again["loss"] = serde_json::json!(9.75);
    text += "this is not json\n";
    text += &format!("{again}\n");
    text += r#"{"step":12,"loss":1.2,"lr":0.0"#; // killed mid-write
    std::fs::write(&path, text).unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(dir.path().join("events.jsonl"))
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"event\":\"checkpoint_sa"))
        .unwrap();

    let out = report(&[dir.path()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains(&format!("metrics.jsonl line {}: invalid JSON", lines_before + 1)), "{stderr}");
    assert!(stderr.contains(&format!("metrics.jsonl line {}: truncated JSON", lines_before + 3)), "{stderr}");
    assert!(stderr.contains("events.jsonl line") && stderr.contains("skipped"), "{stderr}");
    let html = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
    assert!(html.contains("3 line(s) could not be read and were skipped"), "the page lists what was skipped");
    metrics[3]["loss"] = serde_json::json!(9.75);
    assert_eq!(page_series(&data(&html), 0, "loss"), field(&metrics, "loss"));
    assert_eq!(data(&html)["runs"][0]["skipped"].as_array().unwrap().len(), 3);
}

#[test]
fn a_directory_that_is_not_a_run_is_exit_2_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "hello").unwrap();
    for bad in [dir.path().to_path_buf(), dir.path().join("missing")] {
        let out = report(&[&bad]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&bad.display().to_string()) && stderr.contains("not a trainguard run directory"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let none = Command::new(bin()).arg("report").output().unwrap();
    assert_eq!(none.status.code(), Some(2), "no RUN_DIR is a usage error");
}

/// `--out` replaces an earlier page, never a run's own files or anything else.
#[test]
fn out_never_replaces_a_file_that_is_not_a_page() {
    let dir = tempfile::tempdir().unwrap();
    short_run(dir.path(), &[]);
    for name in ["metrics.jsonl", "config.yaml"] {
        let target = dir.path().join(name);
        let before = std::fs::read(&target).unwrap();
        let o = Command::new(bin()).arg("report").arg(dir.path()).arg("--out").arg(&target).output().unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&target.display().to_string()) && stderr.contains("not a report page"),
            "{stderr}"
        );
        assert_eq!(std::fs::read(&target).unwrap(), before, "{name} untouched");
    }
    report_ok(&[dir.path()]);
    report_ok(&[dir.path()]); // the default report.html, written again over itself
}

/// Without `--out` the page goes to `RUN/report.html`: a file of the user's there is left
/// alone, and the message names it as that default path, not as a `--out` nobody typed.
#[test]
fn the_default_page_path_never_replaces_a_users_file_and_says_to_give_out() {
    let dir = tempfile::tempdir().unwrap();
    tiny_run(dir.path());
    let target = dir.path().join("report.html");
    std::fs::write(&target, "my notes on this run\n").unwrap();
    let o = report(&[dir.path()]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    let want = format!(
        "error: {} (where the page goes without --out) exists and is not a report page: give --out",
        target.display()
    );
    assert!(stderr.contains(&want), "{stderr}");
    assert!(!stderr.contains("error: --out"), "no --out was given: {stderr}");
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        "my notes on this run\n",
        "the user's file untouched"
    );
    // `--out` elsewhere writes the page and leaves the file as it is.
    let elsewhere = dir.path().join("page.html");
    assert!(report_ok(&[dir.path(), Path::new("--out"), &elsewhere]).starts_with("<!doctype html>"));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "my notes on this run\n");
}

/// A run directory of a few metrics lines, written by hand (no training).
fn tiny_run(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let lines: String = (0..4)
        .map(|s| format!("{{\"step\":{s},\"loss\":{},\"elapsed_s\":{s}.5}}\n", 5.0 - s as f64))
        .collect();
    std::fs::write(dir.join("metrics.jsonl"), lines).unwrap();
}

/// Two runs whose directories share their name (`A/run`, `B/run`) are told apart in the
/// title, their headers and the legend, by as much of their paths as it takes.
#[test]
fn runs_of_the_same_name_are_told_apart_by_their_paths() {
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("A/run"), root.path().join("B/run"));
    tiny_run(&a);
    tiny_run(&b);
    let out = root.path().join("both.html");
    let o = Command::new(bin()).arg("report").arg(&a).arg(&b).arg("--out").arg(&out).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(&out).unwrap();
    assert!(html.contains("<h1>trainguard report: A/run vs B/run</h1>"), "the title");
    for n in ["A/run", "B/run"] {
        assert!(html.contains(&format!("{n}</h2>")), "run header {n}");
        assert!(html.contains(&format!("{n} · train")), "legend names run {n}");
    }
    let d = data(&html);
    assert_eq!(
        (d["runs"][0]["name"].as_str(), d["runs"][1]["name"].as_str()),
        (Some("A/run"), Some("B/run"))
    );
    // Runs of different names keep their names alone.
    let other = root.path().join("B/other");
    tiny_run(&other);
    let o = Command::new(bin()).arg("report").arg(&a).arg(&other).arg("--out").arg(&out).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read_to_string(&out).unwrap().contains("<h1>trainguard report: run vs other</h1>"));
}

#[test]
fn two_runs_are_overlaid_with_a_legend() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ra = short_run(a.path(), &[]);
    let rb = short_run(b.path(), &["train.lr=1e-3", "train.micro_batch_size=4"]);
    let out = a.path().join("both.html");
    let o = Command::new(bin())
        .args(["report"])
        .arg(a.path())
        .arg(b.path())
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(&out).unwrap();
    let d = data(&html);
    assert_eq!(d["runs"].as_array().unwrap().len(), 2);
    assert_eq!(page_series(&d, 0, "loss"), field(&ra.metrics(), "loss"));
    assert_eq!(page_series(&d, 1, "loss"), field(&rb.metrics(), "loss"));
    let s = svg(&html, "loss-step");
    let (la, lb) = (polyline(s, 0, "loss").unwrap(), polyline(s, 1, "loss").unwrap());
    assert_ne!(attr(la, "stroke"), attr(lb, "stroke"), "runs have their own colours");
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
    for n in [name(a.path()), name(b.path())] {
        assert!(html.contains(&format!("{n} · train")), "legend names run {n}");
    }
    assert!(html.contains("micro 4 × accumulation 8"), "second run's batch in its header");
}

#[test]
fn a_100k_step_run_is_downsampled_keeps_its_spike_and_stays_small() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = String::new();
    for step in 0..100_000u64 {
        let loss =
            if step == 61_803 { 40.0 } else { 3.0 + (step as f64 * 1e-3).sin() * 0.2 - step as f64 * 1e-5 };
        let val = if step % 1000 == 0 { format!("{}", loss + 0.1) } else { "null".into() };
        let micro = if (40_000..40_050).contains(&step) { 4 } else { 8 };
        m += &format!(
            r#"{{"step":{step},"loss":{loss},"lr":{lr},"grad_norm":0.5,"val_loss":{val},"micro_batch":{micro},"accumulation":{acc},"tokens":65536,"tokens_per_s":{tps},"step_time_s":0.25,"elapsed_s":{el},"allocated_bytes":{al},"reserved_bytes":{re},"peak_allocated_bytes":{pa},"peak_reserved_bytes":{re},"alloc_retries":0,"rss_bytes":3000000000,"gpu_memory_used_bytes":{gu},"gpu_memory_total_bytes":85899345920,"gpu_utilization_pct":97,"gpu_temperature_c":61,"gpu_power_w":650.5}}"#,
            lr = 6e-4 * (1.0 - step as f64 / 1e5),
            acc = 32 / micro,
            tps = 250_000.0 + (step % 97) as f64,
            el = step as f64 * 0.25,
            al = 20_000_000_000u64 + step * 1000,
            re = 30_000_000_000u64 + step * 2000,
            pa = 40_000_000_000u64 + (step % 13) * 1_000_000,
            gu = 32_000_000_000u64 + step * 2000,
        );
        m.push('\n');
    }
    std::fs::write(dir.path().join("metrics.jsonl"), m).unwrap();
    let ev: String = (1..=100).map(|i| format!("{{\"event\":\"checkpoint_saved\",\"step\":{},\"path\":\"ck\",\"seconds\":1.0,\"deleted\":[]}}\n", i * 1000)).collect();
    std::fs::write(dir.path().join("events.jsonl"), ev).unwrap();
    let t = Instant::now();
    let html = report_ok(&[dir.path()]);
    let took = t.elapsed();
    assert!(html.len() < 3 << 20, "page is {} bytes", html.len());
    let d = data(&html);
    let loss = page_series(&d, 0, "loss");
    assert!(loss.len() <= 2002, "{} points", loss.len());
    assert!(loss.contains(&(61_803, 40.0)), "the spike survives downsampling");
    assert_eq!((loss[0].0, loss.last().unwrap().0), (0, 99_999));
    let micro = page_series(&d, 0, "micro_batch");
    assert_eq!(
        micro,
        vec![(0, 8.0), (40_000, 4.0), (40_050, 8.0), (99_999, 8.0)],
        "the staircase keeps its changes"
    );
    assert!(svg(&html, "memory-step").contains("device total 80.0 GiB"), "the card's size is drawn");
    assert_eq!(svg(&html, "loss-wall").matches("data-kind=\"checkpoint_saved\"").count(), 100);
    eprintln!("100k steps: {} bytes in {:.2}s", html.len(), took.as_secs_f64());
}

/// Waits for a child up to `limit`, killing it past that.
fn wait(mut cmd: Command, limit: Duration) -> std::process::Output {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start chromium");
    let id = child.id();
    let killer = std::thread::spawn(move || {
        let t = Instant::now();
        while t.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(200));
            if !Path::new(&format!("/proc/{id}")).exists() {
                return;
            }
        }
        let _ = Command::new("kill").arg(id.to_string()).status();
    });
    let out = child.wait_with_output().expect("chromium output");
    let _ = killer.join();
    out
}

fn chromium() -> Option<PathBuf> {
    let candidates = ["chromium", "chromium-browser", "google-chrome"];
    std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .into_iter()
        .chain(candidates.iter().map(PathBuf::from))
        .find(|c| {
            Command::new(c)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
}

#[test]
fn chromium_renders_the_page_without_script_errors() {
    let Some(browser) = chromium() else {
        eprintln!("skipped: no chromium (scripts/setup.sh installs the Debian package `chromium`; set CHROMIUM=path to use another)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    short_run(dir.path(), &[]);
    report_ok(&[dir.path()]);
    let url = format!("file://{}", dir.path().join("report.html").display());
    let profile = tempfile::tempdir().unwrap();
    let base = |c: &mut Command| {
        c.args(["--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--hide-scrollbars"])
            .arg(format!("--user-data-dir={}", profile.path().display()));
    };
    let mut dom = Command::new(&browser);
    base(&mut dom);
    dom.arg("--dump-dom").arg(&url);
    let out = wait(dom, Duration::from_secs(90));
    let html = String::from_utf8_lossy(&out.stdout);
    assert!(
        html.contains("data-status=\"ok\""),
        "the page's script did not finish: {}\n{}",
        html.lines().find(|l| l.contains("data-status")).unwrap_or("<no body>"),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(html.contains("data-panels=\"10 panels, 1 run(s)\""), "{html}");
    assert!(!html.contains("script ok"), "no debug line on the page");

    // A view from the URL, as the page's controls make one: the loss panel on a log scale, every
    // step panel zoomed to steps 3-6, each curve drawn again from the data (all of its points in
    // the range, none outside), the markers outside hidden.
    let mut dom = Command::new(&browser);
    base(&mut dom);
    dom.arg("--dump-dom").arg(format!("{url}#log=loss&x=3-6"));
    let html = String::from_utf8_lossy(&wait(dom, Duration::from_secs(90)).stdout).into_owned();
    assert!(html.contains("data-status=\"ok\""), "{html}");
    let svg = |id: &str| {
        let at = html.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no {id}: {html}"));
        let start = html[..at].rfind("<svg").unwrap();
        html[start..start + html[start..].find("</svg>").unwrap()].to_string()
    };
    let (loss, lr) = (svg("loss-step"), svg("lr-step"));
    let tag = |s: &str| s[..s.find('>').unwrap()].to_string();
    for needle in ["data-log=\"1\"", "data-x0=\"3\"", "data-x1=\"6\""] {
        assert!(tag(&loss).contains(needle), "{needle}: {}", tag(&loss));
    }
    assert!(tag(&lr).contains("data-x0=\"3\"") && !tag(&lr).contains("data-log=\"1\""), "{}", tag(&lr));
    let points = |s: &str, key: &str| {
        let at = s.find(&format!("data-key=\"{key}\"")).unwrap();
        let p = &s[at..];
        let p = &p[p.find("points=\"").unwrap() + 8..];
        p[..p.find('"').unwrap()].split_whitespace().count()
    };
    assert_eq!(points(&loss, "loss"), 4, "steps 3, 4, 5 and 6: {loss}");
    let ticks: Vec<f64> = loss
        .split("class=\"ytick\"")
        .skip(1)
        .filter_map(|t| t[t.find('>')? + 1..t.find('<')?].parse().ok())
        .collect();
    assert!(ticks.len() >= 2 && ticks.iter().all(|t| *t > 0.0), "log-scale ticks: {ticks:?}");

    let shot = dir.path().join("shot.png");
    let mut cmd = Command::new(&browser);
    base(&mut cmd);
    cmd.arg(format!("--screenshot={}", shot.display())).arg("--window-size=1200,1600").arg(&url);
    let out = wait(cmd, Duration::from_secs(90));
    assert!(shot.is_file(), "no screenshot: {}", String::from_utf8_lossy(&out.stderr));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let px: Vec<&[u8]> = buf[..info.buffer_size()].chunks(channels).collect();
    let non_white = px.iter().filter(|p| p[..3].iter().any(|&c| c < 235)).count();
    let distinct: std::collections::HashSet<&[u8]> = px.iter().copied().collect();
    // The train-loss blue (#1f77b4), within anti-aliasing: the curves were drawn, not just text.
    let blue = px
        .iter()
        .filter(|p| {
            (p[0] as i32 - 0x1f).abs() < 20
                && (p[1] as i32 - 0x77).abs() < 20
                && (p[2] as i32 - 0xb4).abs() < 20
        })
        .count();
    assert!(
        non_white * 100 > px.len(),
        "screenshot nearly blank: {non_white} of {} pixels not white",
        px.len()
    );
    assert!(distinct.len() > 50, "only {} colours", distinct.len());
    assert!(blue > 200, "curves missing: {blue} blue pixels");
}

/// What TensorBoard's own reader finds in `tb`: scalars and text summaries by tag.
pub(crate) fn read_tensorboard(tb: &Path) -> Value {
    let python = repo().join(".venv/bin/python");
    let script = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
acc.Reload()
tags = acc.Tags()
print(json.dumps({
    "scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]},
    "text": {t: [[e.step, e.tensor_proto.string_val[0].decode()] for e in acc.Tensors(t)] for t in tags["tensors"]},
}))
"#;
    let out = Command::new(&python).arg("-c").arg(script).arg(tb).output().expect("run the venv's python");
    assert!(
        out.status.success(),
        "reading the event files failed (is tensorboard installed? bash scripts/setup.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// One scalar per numeric metrics.jsonl field, equal (as float32) at every step, none more.
fn assert_scalars_are_the_metrics(got: &Value, metrics: &[Value]) {
    let mut tags = std::collections::BTreeSet::new();
    for m in metrics {
        for (k, v) in m.as_object().unwrap() {
            if k != "step" && v.is_number() {
                tags.insert(k.clone());
            }
        }
    }
    let scalars = got["scalars"].as_object().unwrap();
    assert_eq!(
        scalars.keys().cloned().collect::<std::collections::BTreeSet<_>>(),
        tags,
        "one scalar per numeric metrics field"
    );
    for tag in &tags {
        // TensorBoard scalars are float32: equal as float32.
        let want: Vec<(u64, f32)> = field(metrics, tag).into_iter().map(|(s, v)| (s, v as f32)).collect();
        let have: Vec<(u64, f32)> = scalars[tag]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap() as f32))
            .collect();
        assert_eq!(have, want, "{tag}");
    }
}

#[test]
fn tensorboard_reads_back_the_scalars_of_metrics_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=6",
        "train.warmup_steps=2",
        "train.eval_interval=3",
        "checkpoint.interval=3",
        "metrics.tensorboard=true",
    ];
    let run = train(dir.path(), "configs/debug.yaml", &sets).ok();
    let got = read_tensorboard(&dir.path().join("tb"));
    let first = run.metrics();
    assert_scalars_are_the_metrics(&got, &first);
    let config = &got["text"]["config"][0][1];
    assert!(config.as_str().unwrap().contains("tensorboard: true"), "config text: {config}");
    let events = got["text"]["events"].as_array().unwrap();
    assert!(
        events.iter().any(|e| e[1].as_str().unwrap().contains("\"event\":\"run_finished\"")),
        "{events:?}"
    );
    assert!(events
        .iter()
        .any(|e| e[1].as_str().unwrap().contains("\"event\":\"checkpoint_saved\"") && e[0] == 6));

    // Resumed from step 3, the run logs steps 4-6 again in a new event file: TensorBoard shows
    // them once, as metrics.jsonl does, not the first session's beside them.
    let mut cmd = command(dir.path(), "configs/debug.yaml", &[&sets[..], &["train.lr=0.01"]].concat());
    cmd.arg("--resume").arg(dir.path().join("checkpoints/step-00000003"));
    let resumed = crate::common::run(cmd, dir.path()).ok();
    let metrics = resumed.metrics();
    assert_eq!(metrics.iter().map(|m| m["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    assert_ne!(metrics[4]["loss"], first[4]["loss"], "another learning rate after the resume: other losses");
    assert_eq!(std::fs::read_dir(dir.path().join("tb")).unwrap().count(), 2, "one event file per session");
    assert_scalars_are_the_metrics(&read_tensorboard(&dir.path().join("tb")), &metrics);
}
