//! Memory telemetry and allocator control on the real binary (CPU): `trainguard env`, the
//! allocator settings' validation and merge with the environment, per-step memory fields, the
//! leak warning, and the profiler's trace of chosen steps (`metrics.trace`).
use crate::common::*;
use std::process::Command;

#[test]
fn env_prints_every_section() {
    let out = Command::new(bin()).arg("env").env_remove("PYTORCH_CUDA_ALLOC_CONF").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    // The wheel's NVRTC (torch 2.11.0+cu130 depends on it), found beside libtorch.
    for section in [
        "[trainguard]",
        "[libtorch]",
        "version: 2.11.0",
        "[cuda]",
        "available:",
        "nvrtc: 13.",
        "nvidia/cu13/lib/libnvrtc.so",
        "[gpus]",
        "[allocator]",
        "effective (CUDA runs",
    ] {
        assert!(text.contains(section), "lacks {section}:\n{text}");
    }
    let nvml_present = std::path::Path::new("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").exists();
    if !nvml_present {
        assert!(text.contains("NVML unavailable"), "the NVML-absent path is reported:\n{text}");
    }
}

#[test]
fn config_wins_over_the_environment_and_the_effective_string_is_logged() {
    let out = Command::new(bin())
        .args(["env", "--set", "memory.allocator.max_split_size_mb=256"])
        .env("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("effective (CUDA runs; a CPU run does not use them): max_split_size_mb:256,expandable_segments:False"), "{text}");
    assert!(
        text.contains("source: environment+config")
            && text.contains("max_split_size_mb: environment 128, config 256"),
        "{text}"
    );
    assert!(text.contains("PYTORCH_CUDA_ALLOC_CONF in the environment: max_split_size_mb:128"), "{text}");
    // PyTorch's other name for them, alone: named as the one read.
    let out = Command::new(bin())
        .arg("env")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("PYTORCH_ALLOC_CONF in the environment: max_split_size_mb:64")
            && !text.contains("PYTORCH_CUDA_ALLOC_CONF in"),
        "{text}"
    );
    let out = Command::new(bin())
        .arg("env")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout)
        .contains("PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF in the environment: (unset)"));
    // What a run would refuse or warn of is said by env too.
    let out = Command::new(bin())
        .args([
            "env",
            "--set",
            "memory.allocator.backend=cudaMallocAsync",
            "--set",
            "memory.allocator.expandable_segments=true",
            "--set",
            "memory.allocator.max_split_size_mb=64",
        ])
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("refused (a run with this config exits 2): memory.allocator: the settings")
            && text.contains("memory.allocator.backend: cudaMallocAsync cannot be chosen"),
        "{text}"
    );
    assert!(
        text.contains(
            "warning: memory.allocator.expandable_segments with memory.allocator.max_split_size_mb"
        ),
        "{text}"
    );
    // A combination the environment alone sets is warned of too, named as the environment's.
    let out = Command::new(bin())
        .arg("env")
        .env("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync,max_split_size_mb:128")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "warning: PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb is ignored by backend cudaMallocAsync"
        ),
        "{text}"
    );
    let out = Command::new(bin())
        .arg("env")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("refused"), "the defaults are not refused");
    // What libtorch refuses from the environment, as a run would (exit 2, "libtorch refused them").
    for (conf, why) in [("foo:1", "foo"), ("max_split_size_mb:5", "max_split_size_mb")] {
        let out = Command::new(bin()).arg("env").env("PYTORCH_CUDA_ALLOC_CONF", conf).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "env reports, it does not fail: {text}");
        let line = text
            .lines()
            .find(|l| l.starts_with("refused (a run with this config exits 2)"))
            .unwrap_or_else(|| panic!("{conf} refused:\n{text}"));
        assert!(line.contains("libtorch refused them") && line.contains(why), "{line}");
    }

    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=2", "train.warmup_steps=0", "memory.allocator.max_split_size_mb=256"],
    );
    cmd.env("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False");
    let r = run(cmd, dir.path()).ok();
    let started = &r.events_of("run_started")[0];
    assert_eq!(started["allocator"]["conf"], "max_split_size_mb:256,expandable_segments:False");
    assert!(r.stderr().contains("PYTORCH_CUDA_ALLOC_CONF overridden by the config"), "{}", r.stderr());
    let mut cmd = command(
        &dir.path().join("other"),
        "configs/debug.yaml",
        &["train.max_steps=2", "train.warmup_steps=0", "memory.allocator.max_split_size_mb=256"],
    );
    cmd.env_remove("PYTORCH_CUDA_ALLOC_CONF").env("PYTORCH_ALLOC_CONF", "max_split_size_mb:128");
    let r = run(cmd, dir.path()).ok();
    assert!(
        r.stderr().contains("PYTORCH_ALLOC_CONF overridden by the config: max_split_size_mb"),
        "{}",
        r.stderr()
    );
    // They configure the CUDA allocator: a CPU run says so instead of implying they act.
    assert!(
        r.stderr().contains("(from environment+config; CUDA's caching allocator only, unused on the CPU)"),
        "{}",
        r.stderr()
    );
}

#[test]
fn allocator_settings_are_validated_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "memory.allocator.max_split_size_mb=10",
            "memory.allocator.garbage_collection_threshold=1.5",
            "memory.allocator.backend=tcmalloc",
        ],
    );
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("memory.allocator.backend"), "type error first: {}", r.stderr());
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &["memory.allocator.max_split_size_mb=10", "memory.allocator.garbage_collection_threshold=1.5"],
    );
    assert_eq!(r.code(), 2);
    let err = r.stderr();
    assert!(
        err.contains("memory.allocator.max_split_size_mb: must be >= 20")
            && err.contains("memory.allocator.garbage_collection_threshold"),
        "{err}"
    );
    // A key libtorch itself does not know, coming from the environment: refused, exit 2.
    let mut cmd = command(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=1", "train.warmup_steps=0", "memory.allocator.expandable_segments=true"],
    );
    cmd.env("PYTORCH_CUDA_ALLOC_CONF", "no_such_option:1");
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("libtorch refused them") && r.stderr().contains("no_such_option"),
        "{}",
        r.stderr()
    );
}

#[test]
fn the_allocator_backend_comes_from_the_environment_libtorch_loaded_with() {
    let dir = tempfile::tempdir().unwrap();
    let short = ["train.max_steps=1", "train.warmup_steps=0"];
    // Asked of the config: libtorch chose its backend when it loaded; a clear exit 2, not its
    // internal assert.
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[&short[..], &["memory.allocator.backend=cudaMallocAsync"]].concat(),
    );
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("memory.allocator.backend: cudaMallocAsync cannot be chosen from the config")
            && r.stderr().contains("PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"),
        "{}",
        r.stderr()
    );
    assert!(!r.stderr().contains("INTERNAL ASSERT"), "{}", r.stderr());
    // From the environment, as PyTorch documents it: the run goes on (on CPU the CUDA allocator
    // is never used), and a config that agrees with it is accepted.
    for extra in [&[][..], &["memory.allocator.backend=cudaMallocAsync"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = command(dir.path(), "configs/debug.yaml", &[&short[..], extra].concat());
        cmd.env("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync");
        let r = run(cmd, dir.path());
        assert_eq!(r.code(), 0, "{extra:?}: {}", r.stderr());
    }
}

#[test]
fn metrics_carry_memory_fields_and_a_clean_run_does_not_warn_of_leaks() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &["train.max_steps=60", "train.warmup_steps=5", "memory.leak_check_steps=20"],
    )
    .ok();
    let m = r.metrics();
    let cuda = tch::Cuda::is_available();
    for key in [
        "allocated_bytes",
        "reserved_bytes",
        "peak_allocated_bytes",
        "alloc_retries",
        "gpu_utilization_pct",
        "gpu_power_w",
    ] {
        let line = m[10].as_object().unwrap();
        assert!(line.contains_key(key), "metrics line lacks {key}: {line:?}");
        if !cuda {
            assert!(line[key].is_null(), "{key} on CPU: null, not a made-up number: {line:?}");
        }
    }
    if cuda {
        // The caching allocator's figures are real numbers: the weights alone are allocated.
        for key in ["allocated_bytes", "reserved_bytes", "peak_allocated_bytes"] {
            assert!(m[10][key].as_u64().is_some_and(|b| b > 0), "{key}: {}", m[10]);
        }
        assert!(m[10]["alloc_retries"].is_u64());
    }
    assert!(m[10]["rss_bytes"].as_u64().unwrap() > 0);
    if !tch::Cuda::is_available() {
        assert!(m[10]["allocated_bytes"].is_null(), "no CUDA allocator on CPU");
    }
    assert!(r.events_of("leak_suspected").is_empty(), "{:?}", r.events_of("leak_suspected"));
    assert!(r.stderr().contains("memory summary"), "summary table at the end");
}

#[test]
fn keeping_graphs_across_steps_triggers_the_leak_warning() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(
        dir.path(),
        "configs/debug.yaml",
        &[
            "train.max_steps=40",
            "train.warmup_steps=5",
            "memory.leak_check_steps=20",
            "faults.leak_graphs=true",
        ],
    )
    .ok();
    let leaks = r.events_of("leak_suspected");
    assert_eq!(leaks.len(), 1, "one warning per run");
    assert!(leaks[0]["message"].as_str().unwrap().contains("kept across steps"));
    assert!(r.stderr().contains("possible memory leak"));
}

/// `metrics.trace`: PyTorch's profiler records steps 2 and 3 and nothing else, writes a Chrome
/// trace that holds the model's matrix multiplications under each step's range, summarises where
/// the time went, and leaves the training itself alone (same weights as an untraced run).
#[test]
fn a_trace_of_two_steps_is_a_chrome_trace_with_a_summary_and_changes_nothing() {
    let (traced, plain) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sets = ["train.max_steps=5", "train.warmup_steps=1"];
    let r = train(
        traced.path(),
        "configs/debug.yaml",
        &[&sets[..], &["metrics.trace.from_step=2", "metrics.trace.steps=2"]].concat(),
    )
    .ok();
    train(plain.path(), "configs/debug.yaml", &sets).ok();
    assert_eq!(max_weight_diff(traced.path(), plain.path()), 0.0, "the profiler changed the training");
    assert!(!r.stderr().contains("ERROR"), "no Kineto noise on a CPU run:\n{}", r.stderr());

    let path = traced.path().join("trace/steps_2-3.json");
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let named = |n: &str| events.iter().filter(|e| e["name"] == n).count();
    assert_eq!((named("trainguard step 2"), named("trainguard step 3")), (1, 1), "one range per traced step");
    assert_eq!(named("trainguard step 1") + named("trainguard step 4"), 0, "only the configured steps");
    assert!(named("aten::mm") + named("aten::addmm") > 0, "the matrix multiplications are in the trace");

    let written = r.events_of("trace_written");
    assert_eq!(written.len(), 1, "{written:?}");
    let s = &written[0];
    assert_eq!(
        (s["first_step"].as_u64(), s["steps"].as_u64(), s["counted"].as_str()),
        (Some(2), Some(2), Some("cpu operators"))
    );
    assert_eq!(s["path"].as_str().unwrap(), path.display().to_string());
    let by_work = s["by_work"].as_array().unwrap();
    let total: f64 = by_work.iter().map(|w| w["ms"].as_f64().unwrap()).sum();
    let busy = s["busy_ms"].as_f64().unwrap();
    assert!(
        busy > 0.0 && (total - busy).abs() < 1e-6 * busy,
        "kinds add up to the time counted: {total} vs {busy}"
    );
    let gemm = by_work.iter().find(|w| w["work"] == "gemm").expect("matrix multiplications counted");
    assert!(gemm["share"].as_f64().unwrap() > 0.05, "{s}");
    assert!(r.stderr().contains("trace written to"), "{}", r.stderr());

    // `trainguard trace` tabulates the same file: the same figures, per step.
    let out = Command::new(bin()).arg("trace").arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains(&format!("steps 2-3, cpu operators {:.2} ms per step", busy / 2.0)), "{table}");
    assert!(table.contains(&format!("| gemm | {:.2} |", gemm["ms"].as_f64().unwrap() / 2.0)), "{table}");
    let json = Command::new(bin()).arg("trace").arg("--json").arg(&path).output().unwrap();
    let again: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(again["by_work"], s["by_work"]);
    // A file that is not a trace, or none: exit 2 with the file named.
    let bad = traced.path().join("metrics.jsonl");
    for file in [bad.clone(), traced.path().join("missing.json")] {
        let out = Command::new(bin()).arg("trace").arg(&file).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(&file.display().to_string()), "{err}");
    }
}

/// `trainguard trace` on traces written by hand, as other tools write them: events it cannot
/// use are said once on stderr (how many and why) and the tables printed; a trace with nothing
/// to count, or a gzip-compressed one, is exit 2 saying so; the JSON Array Format is read; a
/// step marked twice is one step.
#[test]
fn trace_says_what_it_skipped_and_refuses_what_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let trace = |name: &str, bytes: &[u8]| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let out = Command::new(bin()).arg("trace").arg(&path).output().unwrap();
        (
            path,
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let kernel = |ts: &str, dur: &str| {
        format!(r#"{{"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": {ts}, "dur": {dur}}}"#)
    };
    let step = |n: u64, ts: u64| {
        format!(
            r#"{{"ph": "X", "cat": "user_annotation", "name": "trainguard step {n}", "tid": 1, "ts": {ts}, "dur": 1000}}"#
        )
    };
    let events = [
        step(1, 0),
        step(1, 0),
        step(2, 1000),
        kernel("0", "1000"),
        kernel("1000", "1000"),
        kernel("1500", "-1"),
        kernel("null", "5"),
        kernel("1600", "\"7\""),
    ];

    let (path, code, table, err) =
        trace("steps_1-2.json", format!(r#"{{"traceEvents": [{}]}}"#, events.join(",")).as_bytes());
    assert_eq!(code, Some(0), "{err}");
    let warning = format!("warning: {}: the figures leave out 3 events they could not read: 1 with `dur` negative, 1 with `dur` not a number, 1 with `ts` null\n", path.display());
    assert_eq!(err, warning, "one warning, once");
    // Steps 1 and 2 (step 1's range twice): 2 ms of kernels over 2 steps.
    assert!(
        table.starts_with(&format!("{}: steps 1-2, gpu kernels 1.00 ms per step", path.display())),
        "{table}"
    );

    // The same events as a bare list (the JSON Array Format).
    let (_, code, table, err) = trace("array.json", format!("[{}]", events.join(",")).as_bytes());
    assert_eq!(code, Some(0), "{err}");
    assert!(table.contains("steps 1-2, gpu kernels 1.00 ms per step"), "{table}");

    for (name, bytes, says) in [
        (
            "empty.json",
            br#"{"traceEvents": []}"#.to_vec(),
            "holds nothing to tabulate: its event list is empty".to_string(),
        ),
        (
            "bad.json",
            format!("[{}]", [kernel("null", "1"), kernel("1", "null")].join(",")).into_bytes(),
            "; 2 events could not be read: 1 with `dur` null, 1 with `ts` null".into(),
        ),
        (
            "steps_1-2.pt.trace.json.gz",
            vec![0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xab, 0xff],
            "is gzip-compressed".into(),
        ),
    ] {
        let (path, code, table, err) = trace(name, &bytes);
        assert_eq!((code, table.as_str()), (Some(2), ""), "{name}: {err}");
        assert!(
            err.starts_with(&format!("error: {}", path.display())) && err.contains(&says),
            "{name}: {err}"
        );
        assert!(!err.contains("UTF-8"), "{err}");
    }
}
