//! Downstream evaluation on the real binary: `trainguard eval` against `transformers` on the
//! exported model (scripts/reference/reference_eval.py: every example's scores and the
//! accuracy), `eval.tasks` in the training loop (metrics.jsonl, TensorBoard, the report, equal to
//! `trainguard eval` on the same weights; two ranks under torchrun equal one process), and bad
//! task files named by file and line with exit 2.
use crate::common::*;
use crate::hf::{prepared, tg, trained_run};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A task file of `n` examples over the test corpus' words (its tokenizer encodes them): the
/// right ending continues the corpus' sentence, the others are shuffled words. Both context
/// layouts, numeric and string labels, an accented ending (characters ≠ bytes) and contexts
/// longer than the model's window of 16 tokens (truncated from the left).
fn generated_task(path: &Path, n: usize) {
    let words = ["the", "cat", "dog", "rain", "inner", "sat", "on", "mat", "and", "ran", "after", "her"];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |m: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % m as u64) as usize
    };
    let mut lines = String::new();
    for i in 0..n {
        let animal = ["dog", "rain", "inner"][i % 3];
        let context = match i % 4 {
            3 => format!(
                "the cat {animal} sat on the mat and ran after her {} the cat {animal} sat on the",
                i % 7
            ),
            _ => format!("the cat {animal} sat on the"),
        };
        // At most 12 characters: the test tokenizer has few merges, the window is 16 tokens.
        let right = ["mat and ran", "mat and", "mat"][i % 3].to_string();
        let mut endings: Vec<String> = (0..3)
            .map(|_| (0..1 + next(2)).map(|_| words[next(words.len())]).collect::<Vec<_>>().join(" "))
            .collect();
        if i == 5 {
            endings[0] = "mât and ràn".into();
        }
        let label = next(4);
        endings.insert(label, right);
        let o = match i % 2 {
            0 => serde_json::json!({"ind": i, "ctx": context, "endings": endings, "label": label}),
            _ => {
                let (a, b) = context.split_at(context.find(" sat").unwrap());
                serde_json::json!({"ctx_a": a, "ctx_b": b.trim_start(), "endings": endings, "label": label.to_string()})
            }
        };
        lines.push_str(&format!("{o}\n"));
    }
    std::fs::write(path, lines).unwrap();
}

/// Whether the venv has transformers (scripts/setup.sh installs it).
fn have_transformers() -> bool {
    let ok = std::process::Command::new(repo().join(".venv/bin/python"))
        .args(["-c", "import transformers"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: transformers is not installed in .venv (bash scripts/setup.sh)");
    }
    ok
}

fn scores(path: &Path) -> Vec<Value> {
    read_jsonl(path)
}

fn eval(target: &Path, task: &Path, extra: &[&str]) -> crate::common::Run {
    let task = format!("gen={}", task.display());
    tg(&[&["eval", target.to_str().unwrap(), "--task", &task, "--device", "cpu"], extra].concat())
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// Every example's summed log-likelihoods within 1e-4 of transformers' (fp32; measured ~1e-6),
/// its token and character counts and both choices equal, and so the accuracies.
#[test]
fn eval_scores_every_example_as_transformers_does_on_the_exported_model() {
    if !have_transformers() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let run_dir = trained_run(d.path());
    let hf = d.path().join("hf");
    tg(&["export", run_dir.to_str().unwrap(), "--hf", hf.to_str().unwrap()]).ok();
    let task = d.path().join("gen.jsonl");
    generated_task(&task, 24);
    let ours = d.path().join("ours.jsonl");
    let r = eval(&run_dir, &task, &["--scores", ours.to_str().unwrap(), "--json"]).ok();
    let result: Value = serde_json::from_str(r.stdout().trim()).unwrap();
    let theirs = d.path().join("theirs.jsonl");
    let script = repo().join("scripts/reference/reference_eval.py");
    let out = std::process::Command::new(repo().join(".venv/bin/python"))
        .arg(&script)
        .args(["--model".as_ref(), hf.as_os_str(), "--task".as_ref(), task.as_os_str()])
        .args(["--scores".as_ref(), theirs.as_os_str()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reference: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (ours, theirs) = (scores(&ours), scores(&theirs));
    assert_eq!(ours.len(), 24);
    assert_eq!(theirs.len(), 24);
    let mut worst = 0.0f64;
    for (a, b) in ours.iter().zip(&theirs) {
        assert_eq!(a["task"], "gen");
        for key in ["index", "label", "tokens", "chars", "pred", "pred_norm"] {
            assert_eq!(a[key], b[key], "{key} of example {}", a["index"]);
        }
        for (x, y) in floats(&a["sums"]).iter().zip(floats(&b["sums"])) {
            assert!(x.is_finite() && *x < 0.0, "{a}");
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst < 1e-4, "summed log-likelihoods differ by up to {worst}");
    eprintln!(
        "largest difference from transformers: {worst:.2e}; example 0: {} vs {}",
        ours[0]["sums"], theirs[0]["sums"]
    );
    // Not a degenerate model: the endings' sums differ, and length normalisation changes choices.
    assert!(ours.iter().any(|s| s["pred"] != s["pred_norm"]), "acc and acc_norm never differ");
    assert_eq!(result["acc"], reference["acc"]);
    assert_eq!(result["acc_norm"], reference["acc_norm"]);
    assert_eq!(result["examples"], 24);
    // The example with the accented ending counts characters, not bytes.
    assert_eq!(ours[5]["chars"][0], " mât and ràn".chars().count());
    // The export itself is read the same way (its tokenizer.json, the EOS it names).
    let from_hf = d.path().join("hf.jsonl");
    eval(&hf, &task, &["--scores", from_hf.to_str().unwrap()]).ok();
    for (a, b) in scores(&from_hf).iter().zip(&ours) {
        assert_eq!(a["pred"], b["pred"]);
        let diff =
            floats(&a["sums"]).iter().zip(floats(&b["sums"])).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(diff < 1e-5, "{diff}");
    }
    // --max-examples scores the first ones only; the text line says both accuracies.
    let r = eval(&run_dir, &task, &["--max-examples", "4"]).ok();
    assert!(r.stdout().starts_with("gen: acc ") && r.stdout().contains("/4), acc_norm"), "{}", r.stdout());
}

fn train_with_tasks(dir: &Path, data: &Path, task: &Path, sets: &[&str]) -> Vec<String> {
    let mut all = vec![
        format!("data.source=tokens:{}", data.display()),
        "model.vocab_size=265".into(),
        "model.n_embd=32".into(),
        "model.seq_len=16".into(),
        "train.max_steps=12".into(),
        "train.warmup_steps=2".into(),
        "train.eval_interval=6".into(),
        "train.global_batch_size=8".into(),
        format!("eval.tasks=[{{name: gen, path: {}}}]", task.display()),
    ];
    all.extend(sets.iter().map(|s| s.to_string()));
    let _ = dir;
    all
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `eval.tasks` in the loop: the fields on the steps that evaluate (eval.every_steps), equal to
/// `trainguard eval` on the final weights; TensorBoard and the report show them.
#[test]
fn tasks_scored_in_the_loop_reach_metrics_tensorboard_and_the_report() {
    let d = tempfile::tempdir().unwrap();
    let data = prepared(d.path());
    let task = d.path().join("gen.jsonl");
    generated_task(&task, 20);
    let run_dir = d.path().join("run");
    let sets = train_with_tasks(&run_dir, &data, &task, &["eval.every_steps=4", "metrics.tensorboard=true"]);
    let run = train(&run_dir, "configs/debug.yaml", &refs(&sets)).ok();
    let metrics = run.metrics();
    let scored: Vec<u64> = metrics
        .iter()
        .filter(|m| m.get("eval_gen_acc").is_some())
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(scored, [4, 8, 12], "every 4 steps (and the last)");
    let last = metrics.last().unwrap();
    for key in ["eval_gen_acc", "eval_gen_acc_norm", "eval_acc", "eval_acc_norm"] {
        let v = last[key].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&v), "{key}: {v}");
    }
    assert_eq!(last["eval_acc"], last["eval_gen_acc"], "one task: the mean is its own");
    assert!(run.stderr().contains("| gen "), "the log line names the task: {}", run.stderr());
    // The final weights scored alone give the same counts.
    let alone = eval(&run_dir, &task, &["--json"]).ok();
    let alone: Value = serde_json::from_str(alone.stdout().trim()).unwrap();
    assert_eq!(alone["acc"], last["eval_gen_acc"]);
    assert_eq!(alone["acc_norm"], last["eval_gen_acc_norm"]);
    // TensorBoard's scalars hold them.
    let tb = crate::report::read_tensorboard(&run_dir.join("tb"));
    let acc = tb["scalars"]["eval_gen_acc"].as_array().unwrap();
    assert_eq!(acc.iter().map(|p| p[0].as_u64().unwrap()).collect::<Vec<_>>(), [4, 8, 12]);
    // The report draws the mean and names the task's last figures.
    let page = d.path().join("report.html");
    tg(&["report", run_dir.to_str().unwrap(), "--out", page.to_str().unwrap()]).ok();
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("Downstream accuracy"), "the panel");
    let figure = format!("{:.4}", last["eval_gen_acc"].as_f64().unwrap());
    assert!(html.contains("eval gen") && html.contains(&figure), "the header's row for the task");
}

/// Two ranks under torchrun each score half of the examples; the summed counts equal one
/// process's on the same weights.
#[test]
fn two_ranks_split_the_examples_and_report_the_whole_task() {
    let d = tempfile::tempdir().unwrap();
    let data = prepared(d.path());
    let task = d.path().join("gen.jsonl");
    generated_task(&task, 21);
    let run_dir = d.path().join("run");
    let sets = train_with_tasks(&run_dir, &data, &task, &["dist.timeout_s=30", "train.micro_batch_size=4"]);
    let mut cmd = std::process::Command::new(torchrun());
    cmd.args([
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        &format!("--master_port={}", free_port()),
        "--no-python",
    ]);
    let train_cmd = command(&run_dir, "configs/debug.yaml", &refs(&sets));
    cmd.arg(train_cmd.get_program()).args(train_cmd.get_args());
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let metrics = read_jsonl(&run_dir.join("metrics.jsonl"));
    let last = metrics.last().unwrap();
    assert_eq!(last["step"], 12);
    let alone = eval(&run_dir, &task, &["--json"]).ok();
    let alone: Value = serde_json::from_str(alone.stdout().trim()).unwrap();
    assert_eq!(alone["examples"], 21);
    assert_eq!(alone["acc"], last["eval_gen_acc"], "21 examples: 11 on rank 0, 10 on rank 1, summed");
    assert_eq!(alone["acc_norm"], last["eval_gen_acc_norm"]);
}

/// A malformed line is named by file and line, exit 2, by `eval` and by `train` (before the run
/// directory is made); so is a name that cannot be a metrics field.
#[test]
fn a_bad_task_file_is_named_by_file_and_line() {
    let d = tempfile::tempdir().unwrap();
    let data = prepared(d.path());
    let task = d.path().join("bad.jsonl");
    std::fs::write(&task, "{\"ctx\": \"the cat\", \"endings\": [\"sat\", \"ran\"], \"label\": 1}\n{\"ctx\": \"the\", \"endings\": [\"a\", \"b\"], \"label\": 5}\n").unwrap();
    let run_dir = d.path().join("run");
    let sets = train_with_tasks(&run_dir, &data, &task, &[]);
    let r = train(&run_dir, "configs/debug.yaml", &refs(&sets));
    assert_eq!(r.code(), 2, "{}", r.stderr());
    let said = format!("{}:2: `label` must be the index of the right ending, 0..2", task.display());
    assert!(r.stderr().contains(&said), "{}", r.stderr());
    assert!(!r.stderr().contains("panicked"));
    assert!(!run_dir.join("metrics.jsonl").exists(), "refused before training");
    std::fs::create_dir(d.path().join("t")).unwrap();
    let trained: PathBuf = trained_run(&d.path().join("t"));
    let r = eval(&trained, &task, &[]);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains(&said), "{}", r.stderr());
    let r = tg(&["eval", trained.to_str().unwrap(), "--task", "a b=x.jsonl"]);
    assert_eq!(r.code(), 2);
    assert!(r.stderr().contains("letters, digits"), "{}", r.stderr());
    let sets = train_with_tasks(&run_dir, &data, &task, &["eval.every_steps=0"]);
    let r = train(&run_dir, "configs/debug.yaml", &refs(&sets));
    assert_eq!(r.code(), 2);
    assert!(r.stderr().contains("eval.every_steps: must be at least 1"), "{}", r.stderr());
}
