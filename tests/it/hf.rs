//! `sample`, `export --hf` and `init_from` on the real binary, checked against `transformers`
//! (the venv's pinned version, CPU, fp32): an exported run gives the same logits there, a model
//! saved by `transformers` gives the same logits here, and export → load is bit-exact.
use crate::common::*;
use crate::support::tokenizer;
use std::path::{Path, PathBuf};
use std::process::Command;

const IDS: &str = "5,17,30,2,9,100,200,64";

pub(crate) fn tg(args: &[&str]) -> Run {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    run(cmd, Path::new("."))
}

fn python(script: &str, args: &[&Path]) -> String {
    let out = Command::new(repo().join(".venv/bin/python"))
        .args(["-c", script])
        .args(args)
        .output()
        .expect("the venv's python");
    assert!(out.status.success(), "python failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn logits(target: &Path, file: &Path) -> tch::Tensor {
    tg(&[
        "sample",
        target.to_str().unwrap(),
        "--ids",
        IDS,
        "--device",
        "cpu",
        "--dump-logits",
        file.to_str().unwrap(),
    ])
    .ok();
    tch::Tensor::read_safetensors(file).unwrap().remove(0).1
}

const TRANSFORMERS_LOGITS: &str = "
import sys, torch, transformers
from safetensors.torch import load_file
m = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor([[5,17,30,2,9,100,200,64]])
with torch.no_grad():
    l = m(ids).logits
print((l - load_file(sys.argv[2])['logits']).abs().max().item())
";

/// A small run trained on a prepared dataset (with the test tokenizer).
pub(crate) fn trained_run(root: &Path) -> PathBuf {
    let data = prepared(root);
    let out = root.join("run");
    let source = format!("data.source=tokens:{}", data.display());
    train(
        &out,
        "configs/debug.yaml",
        &[
            &source,
            "model.vocab_size=265",
            "model.n_embd=32",
            "model.seq_len=16",
            "train.max_steps=30",
            "train.warmup_steps=3",
            "train.eval_interval=30",
        ],
    )
    .ok();
    out
}

/// A small corpus prepared with the test tokenizer (vocabulary 265, EOS 264).
pub(crate) fn prepared(root: &Path) -> PathBuf {
    tokenizer::write(&root.join("tokenizer.json"), 0);
    let text: String = (0..600)
        .map(|i| {
            format!(
                "the cat {} sat on the mat and ran after her {}\n\n",
                ["dog", "rain", "inner"][i % 3],
                i % 7
            )
        })
        .collect();
    std::fs::write(root.join("c.txt"), text).unwrap();
    let data = root.join("data");
    let mut cmd = Command::new(bin());
    cmd.arg("prepare")
        .arg("--tokenizer")
        .arg(root.join("tokenizer.json"))
        .arg("--out")
        .arg(&data)
        .arg(root.join("c.txt"))
        .args(["--val-tokens", "2000"]);
    run(cmd, root).ok();
    data
}

#[test]
fn samples_are_deterministic_per_seed_and_decoded_with_the_runs_tokenizer() {
    let d = tempfile::tempdir().unwrap();
    let run_dir = trained_run(d.path());
    let s = |seed: &str| {
        tg(&[
            "sample",
            run_dir.to_str().unwrap(),
            "--prompt",
            "the cat",
            "--max-tokens",
            "30",
            "--seed",
            seed,
            "--device",
            "cpu",
        ])
        .ok()
        .stdout()
    };
    let (a, b, c) = (s("1"), s("1"), s("2"));
    assert_eq!(a, b);
    assert_ne!(a, c);
    // Decoded text, not ids: the model learned the corpus' words.
    assert!(a.contains(" the") || a.contains("cat") || a.contains("mat"), "{a:?}");
    let greedy = tg(&[
        "sample",
        run_dir.join("checkpoints/step-00000030").to_str().unwrap(),
        "--prompt",
        "the cat",
        "--temperature",
        "0",
        "--max-tokens",
        "5",
    ])
    .ok()
    .stdout();
    assert!(!greedy.is_empty());
    let bad = tg(&["sample", d.path().to_str().unwrap(), "--prompt", "x"]);
    assert_eq!(bad.code(), 2, "{}", bad.stderr());
}

/// The continuation ends before the first end-of-document token drawn (the run's documents
/// each end with one), unless --ignore-eos; and it is printed as it is drawn, the drawing
/// stopping once no one reads.
#[test]
fn sampling_stops_at_the_end_of_document_and_streams_until_the_reader_goes() {
    use std::io::Read;
    let d = tempfile::tempdir().unwrap();
    let run_dir = trained_run(d.path());
    // Near-uniform draws over all 265 ids: an EOS (id 264) comes within 2,000 for this seed.
    let s = |more: &[&str]| {
        tg(&[
            &[
                "sample",
                run_dir.to_str().unwrap(),
                "--prompt",
                "the cat",
                "--max-tokens",
                "2000",
                "--temperature",
                "50",
                "--top-k",
                "0",
                "--seed",
                "3",
                "--device",
                "cpu",
            ],
            more,
        ]
        .concat())
        .ok()
        .stdout()
    };
    let (stopped, on) = (s(&[]), s(&["--ignore-eos"]));
    let eos = on.find("<|endoftext|>").unwrap_or_else(|| panic!("no EOS drawn: {on:?}"));
    assert_eq!(stopped, on[..eos], "the same draws, cut before the EOS");
    assert!(!stopped.contains("<|endoftext|>"));
    // A million tokens take many minutes to draw (held back to the end, the first would come
    // after all of them); drawn in turn, the first come at once, and a reader that leaves ends it.
    let mut child = Command::new(bin())
        .args([
            "sample",
            run_dir.to_str().unwrap(),
            "--prompt",
            "the cat",
            "--max-tokens",
            "1000000",
            "--ignore-eos",
            "--device",
            "cpu",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Text held back to the end would keep the read below waiting: killed after 30 s, it
    // reads nothing.
    let (done, watched) = std::sync::mpsc::channel::<()>();
    let pid = child.id() as i32;
    let watchdog = std::thread::spawn(move || {
        if watched.recv_timeout(std::time::Duration::from_secs(30)).is_err() {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    let n = stdout.read(&mut first).unwrap();
    let _ = done.send(()); // gone: the watchdog killed it
    watchdog.join().unwrap();
    assert!(
        n > 0 && child.try_wait().unwrap().is_none(),
        "text before the end, with the drawing still going on"
    );
    drop(stdout);
    let since = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if since.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("still drawing 60 s after its reader left");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0), "a reader gone ends it quietly");
}

/// A run whose `data.source` is given relative (as README's example gives it) records it
/// absolute and samples the same from another directory. One recorded relative (by an earlier
/// version), sampled and exported from another directory, and then with its dataset's tokenizer
/// gone: each says why the tokenizer cannot be had, where it once said "not a prepare directory"
/// or exported without it in silence (or, with the tokenizer gone, failed naming the output and
/// left half an export).
#[test]
fn a_runs_tokenizer_out_of_reach_is_named_by_sample_and_export() {
    let d = tempfile::tempdir().unwrap();
    prepared(d.path());
    let mut cmd = command(
        Path::new("run"),
        "configs/debug.yaml",
        &[
            "data.source=tokens:data",
            "model.vocab_size=265",
            "model.n_embd=32",
            "model.seq_len=16",
            "train.max_steps=4",
            "train.warmup_steps=1",
            "train.eval_interval=0",
        ],
    );
    cmd.current_dir(d.path());
    run(cmd, d.path()).ok();
    let run_dir = d.path().join("run");
    let sample = |cwd: &Path| {
        let mut cmd = Command::new(bin());
        cmd.current_dir(cwd).args([
            "sample",
            run_dir.to_str().unwrap(),
            "--prompt",
            "the cat",
            "--max-tokens",
            "3",
            "--device",
            "cpu",
        ]);
        run(cmd, cwd)
    };
    let here = sample(d.path()).ok();
    // The run recorded its relative source against the directory it ran in: the run directory
    // reads the same from anywhere.
    let recorded = std::fs::read_to_string(run_dir.join("config.yaml")).unwrap();
    let absolute = format!("source: tokens:{}", d.path().join("data").display());
    assert!(recorded.contains(&absolute), "{recorded}");
    assert_eq!(sample(&repo()).ok().stdout(), here.stdout(), "sampled from another directory");
    // A run recorded before (its source relative) is read from where training ran only.
    std::fs::write(run_dir.join("config.yaml"), recorded.replace(&absolute, "source: tokens:data")).unwrap();
    let elsewhere = sample(&repo());
    assert_eq!(elsewhere.code(), 2, "{}", elsewhere.stderr());
    assert!(
        elsewhere.stderr().contains("data.source `tokens:data` is not found from")
            && elsewhere.stderr().contains("run it from the one training ran in"),
        "{}",
        elsewhere.stderr()
    );
    let export = |cwd: &Path, to: &str| {
        let mut cmd = Command::new(bin());
        cmd.current_dir(cwd).args([
            "export",
            run_dir.to_str().unwrap(),
            "--hf",
            d.path().join(to).to_str().unwrap(),
        ]);
        run(cmd, cwd).ok()
    };
    let r = export(&repo(), "hf-elsewhere");
    assert!(
        r.stderr().contains("is not found from") && r.stderr().contains("exporting without a tokenizer"),
        "{}",
        r.stderr()
    );
    assert!(!d.path().join("hf-elsewhere/tokenizer.json").exists());
    // An export of an export carries its tokenizer.
    export(d.path(), "hf-here");
    let mut again = Command::new(bin());
    again.args([
        "export",
        d.path().join("hf-here").to_str().unwrap(),
        "--hf",
        d.path().join("hf-again").to_str().unwrap(),
    ]);
    run(again, d.path()).ok();
    assert_eq!(
        std::fs::read(d.path().join("hf-again/tokenizer.json")).unwrap(),
        std::fs::read(d.path().join("data/tokenizer.json")).unwrap()
    );
    // A damaged tokenizer is as unusable as a missing one: not copied into an export that
    // transformers could not load.
    std::fs::write(d.path().join("data/tokenizer.json"), "{broken").unwrap();
    let r = export(d.path(), "hf-damaged");
    assert!(
        r.stderr().contains("not a tokenizer.json: not JSON")
            && r.stderr().contains("exporting without a tokenizer"),
        "{}",
        r.stderr()
    );
    assert!(
        d.path().join("hf-damaged/model.safetensors").is_file()
            && !d.path().join("hf-damaged/tokenizer.json").exists()
    );
    let damaged = sample(d.path());
    assert_eq!(damaged.code(), 2, "{}", damaged.stderr());
    assert!(damaged.stderr().contains("not a tokenizer.json: not JSON"), "{}", damaged.stderr());
    std::fs::remove_file(d.path().join("data/tokenizer.json")).unwrap();
    let r = export(d.path(), "hf-no-tokenizer");
    assert!(
        r.stderr().contains("data/tokenizer.json is missing: the tokenizer of the run's data.source")
            && r.stderr().contains("exporting without a tokenizer"),
        "{}",
        r.stderr()
    );
    assert!(
        d.path().join("hf-no-tokenizer/model.safetensors").is_file()
            && !d.path().join("hf-no-tokenizer/tokenizer.json").exists()
    );
}

/// An export whose write fails (a real EFBIG: a file-size limit below the weights, SIGXFSZ
/// ignored) leaves no part of itself: no model.safetensors or config.json that would refuse the
/// retry, no staging directory, and a directory it created is gone again; a directory the user
/// gave keeps what it held. The retry then exports.
#[test]
fn a_failed_export_leaves_nothing_that_refuses_the_retry() {
    let d = tempfile::tempdir().unwrap();
    let data = prepared(d.path());
    let run_dir = d.path().join("run");
    let source = format!("data.source=tokens:{}", data.display());
    train(
        &run_dir,
        "configs/debug.yaml",
        &[
            &source,
            "model.vocab_size=265",
            "model.n_embd=32",
            "model.seq_len=16",
            "train.max_steps=2",
            "train.warmup_steps=1",
            "train.eval_interval=0",
        ],
    )
    .ok();
    let export = |to: &Path, limited: bool| {
        let mut cmd = Command::new(bin());
        cmd.args(["export", run_dir.to_str().unwrap(), "--hf", to.to_str().unwrap()]);
        if limited {
            // The weights are ~240 KB; the limit is below them.
            limit_file_size(&mut cmd, 100_000);
        }
        run(cmd, d.path())
    };
    let fresh = d.path().join("hf");
    let given = d.path().join("given");
    std::fs::create_dir(&given).unwrap();
    std::fs::write(given.join("README.md"), "mine").unwrap();
    for to in [&fresh, &given] {
        let r = export(to, true);
        assert_eq!(r.code(), 1, "{}", r.stderr());
        assert!(
            r.error_line().contains(&format!("cannot write {}", to.join("model.safetensors").display()))
                && r.stderr().contains("File too large"),
            "{}",
            r.stderr()
        );
    }
    assert!(!fresh.exists(), "the directory the export created is removed");
    // A file of the user's under one of the export's names is not replaced.
    let theirs = d.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::write(theirs.join("generation_config.json"), "mine").unwrap();
    let r = export(&theirs, false);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("already holds generation_config.json, which the export would replace"),
        "{}",
        r.stderr()
    );
    assert_eq!(std::fs::read_to_string(theirs.join("generation_config.json")).unwrap(), "mine");
    // A whole export whose summary line cannot be printed is a success, not a failure whose
    // retry its own files would refuse.
    let full = d.path().join("full");
    let mut cmd = Command::new(bin());
    cmd.args(["export", run_dir.to_str().unwrap(), "--hf", full.to_str().unwrap()])
        .stdout(std::fs::File::create("/dev/full").unwrap());
    let r = run(cmd, d.path());
    assert_eq!(r.code(), 0, "{}", r.stderr());
    assert!(
        r.stderr().contains("was written; only its summary line could not be printed")
            && full.join("config.json").is_file(),
        "{}",
        r.stderr()
    );
    let left: Vec<String> = std::fs::read_dir(&given)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["README.md"], "the user's file alone, no staging directory");
    for to in [&fresh, &given] {
        export(to, false).ok();
        for f in [
            "config.json",
            "model.safetensors",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            assert!(to.join(f).is_file(), "{f} in {}", to.display());
        }
    }
}

/// A resume takes its weights from the checkpoint: the `init_from` directory the run started
/// from may be gone by then (it was refused, exit 2, as if the run needed it). Without a
/// checkpoint to resume from, the run needs it and says so by key.
#[test]
fn a_resume_does_not_need_the_init_from_directory() {
    let d = tempfile::tempdir().unwrap();
    let source = d.path().join("source");
    train(
        &source,
        "configs/debug.yaml",
        &["train.max_steps=2", "train.warmup_steps=1", "train.eval_interval=0"],
    )
    .ok();
    let hf = d.path().join("hf");
    tg(&["export", source.to_str().unwrap(), "--hf", hf.to_str().unwrap()]).ok();
    let init = format!("init_from={}", hf.display());
    let sets = [
        init.as_str(),
        "train.max_steps=6",
        "train.warmup_steps=1",
        "train.eval_interval=0",
        "checkpoint.interval=3",
    ];
    let out = d.path().join("run");
    let first = train(&out, "configs/debug.yaml", &[&sets[..], &["faults.interrupt_at_step=3"]].concat());
    assert_eq!(first.code(), 4, "{}", first.stderr());
    std::fs::remove_dir_all(&hf).unwrap();
    let resume = |dir: &Path| {
        let mut cmd = command(dir, "configs/debug.yaml", &sets);
        cmd.args(["--resume", "auto"]);
        run(cmd, dir)
    };
    let r = resume(&out).ok();
    assert_eq!(r.summary()["steps"], 6, "{}", r.stderr());
    let fresh = resume(&d.path().join("new"));
    assert_eq!(fresh.code(), 2, "{}", fresh.stderr());
    assert!(
        fresh.error_line().contains(&format!(
            "init_from: {}: is not a Hugging Face model directory (no config.json)",
            hf.display()
        )),
        "{}",
        fresh.stderr()
    );
}

/// A dataset re-prepared in place with another tokenizer keeps its path: the run's checkpoints
/// record its tokenizer, so `sample` and `export` do not pair the model with the new one, and a
/// resume, whose token ids would mean other text, is refused by name.
#[test]
fn a_dataset_retokenized_in_place_is_not_taken_for_the_one_the_run_trained_on() {
    let d = tempfile::tempdir().unwrap();
    let data = prepared(d.path());
    let run_dir = d.path().join("run");
    let source = format!("data.source=tokens:{}", data.display());
    let sets = [
        source.as_str(),
        "model.vocab_size=400",
        "model.n_embd=32",
        "model.seq_len=16",
        "train.max_steps=3",
        "train.warmup_steps=1",
        "train.eval_interval=0",
    ];
    train(&run_dir, "configs/debug.yaml", &sets).ok();
    let sample = || {
        tg(&[
            "sample",
            run_dir.to_str().unwrap(),
            "--prompt",
            "the cat",
            "--max-tokens",
            "3",
            "--device",
            "cpu",
        ])
    };
    sample().ok();
    // The same corpus, prepared again into the same directory with a larger tokenizer.
    std::fs::remove_dir_all(&data).unwrap();
    tokenizer::write(&d.path().join("tokenizer.json"), 300);
    let mut cmd = Command::new(bin());
    cmd.arg("prepare")
        .arg("--tokenizer")
        .arg(d.path().join("tokenizer.json"))
        .arg("--out")
        .arg(&data)
        .arg(d.path().join("c.txt"))
        .args(["--val-tokens", "2000"]);
    run(cmd, d.path()).ok();
    let r = sample();
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("is not the tokenizer the run trained with")
            && r.stderr().contains("re-prepared since?"),
        "{}",
        r.stderr()
    );
    let hf = d.path().join("hf");
    let r = tg(&["export", run_dir.to_str().unwrap(), "--hf", hf.to_str().unwrap()]).ok();
    assert!(
        r.stderr().contains("is not the tokenizer the run trained with")
            && r.stderr().contains("exporting without a tokenizer"),
        "{}",
        r.stderr()
    );
    assert!(!hf.join("tokenizer.json").exists());
    let mut cmd = command(&run_dir, "configs/debug.yaml", &[&sets[..], &["train.max_steps=5"]].concat());
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, &run_dir);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.error_line().contains("its tokenizer.json is not the one step 3 trained with"),
        "{}",
        r.stderr()
    );
}

#[test]
fn byte_level_runs_sample_bytes() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("t.txt");
    std::fs::write(&f, "abcabcabd ".repeat(400)).unwrap();
    let source = format!("data.source=text:{}", f.display());
    train(
        &d.path().join("run"),
        "configs/debug.yaml",
        &[&source, "model.seq_len=16", "train.max_steps=40", "train.warmup_steps=3"],
    )
    .ok();
    let out = tg(&[
        "sample",
        d.path().join("run").to_str().unwrap(),
        "--prompt",
        "abca",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
    ])
    .ok()
    .stdout();
    assert_eq!(out.len(), 8, "{out:?}");
    assert!(out.bytes().all(|b| b"abcd ".contains(&b)), "{out:?}");
    // On a terminal (util-linux's `script` gives it one) a line end follows, so the shell's
    // prompt does not; piped, as above, the bytes are the model's alone.
    let cmd = format!(
        "{} sample {} --prompt abca --temperature 0 --max-tokens 8",
        bin(),
        d.path().join("run").display()
    );
    let tty = std::process::Command::new("script").args(["-qec", &cmd, "/dev/null"]).output().unwrap();
    let shown = String::from_utf8_lossy(&tty.stdout).to_string();
    assert_eq!(shown, format!("{out}\r\n"), "the terminal's bytes");
}

/// What `sample` says of a target it cannot read, naming the reason: no such directory; a run
/// whose only checkpoint is corrupt (the checkpoint and its fault named, as `--resume` names
/// them); a run without its config.yaml samples from its checkpoint, which carries its own.
#[test]
fn sample_names_why_a_target_cannot_be_read() {
    let d = tempfile::tempdir().unwrap();
    let run_dir = d.path().join("run");
    train(
        &run_dir,
        "configs/debug.yaml",
        &[
            "train.max_steps=4",
            "train.warmup_steps=1",
            "train.eval_interval=0",
            "checkpoint.at_end=false",
            "checkpoint.interval=4",
        ],
    )
    .ok();
    let sample = |target: &Path| {
        tg(&["sample", target.to_str().unwrap(), "--prompt", "ab", "--max-tokens", "4", "--temperature", "0"])
    };
    let missing = sample(&d.path().join("nowhere"));
    assert_eq!(missing.code(), 2, "{}", missing.stderr());
    assert!(missing.stderr().contains("no such directory"), "{}", missing.stderr());
    let want = sample(&run_dir).ok().stdout();
    std::fs::remove_file(run_dir.join("config.yaml")).unwrap();
    assert_eq!(sample(&run_dir).ok().stdout(), want, "from the checkpoint's own config");
    let model = run_dir.join("checkpoints/step-00000004/model.safetensors");
    std::fs::write(&model, &std::fs::read(&model).unwrap()[..1000]).unwrap();
    let corrupt = sample(&run_dir);
    assert_eq!(corrupt.code(), 2, "{}", corrupt.stderr());
    assert!(
        corrupt.stderr().contains("no checkpoint loads")
            && corrupt.stderr().contains("step-00000004")
            && corrupt.stderr().contains("truncated"),
        "{}",
        corrupt.stderr()
    );
}

#[test]
fn an_exported_run_gives_the_same_logits_in_transformers_and_loads_back_bit_exact() {
    let d = tempfile::tempdir().unwrap();
    let run_dir = trained_run(d.path());
    let hf = d.path().join("hf");
    let r = tg(&["export", run_dir.to_str().unwrap(), "--hf", hf.to_str().unwrap()]).ok();
    assert!(r.stdout().contains("tokenizer.json"), "{}", r.stdout());
    let ours = d.path().join("ours.safetensors");
    let l = logits(&run_dir, &ours);
    let diff: f64 = python(TRANSFORMERS_LOGITS, &[&hf, &ours]).trim().parse().unwrap();
    assert!(diff < 1e-4, "transformers' logits differ by {diff}");
    // The tokenizer travels: transformers encodes text as the prepared dataset did.
    let first_doc = "the cat dog sat on the mat and ran after her 0";
    let enc = python(&format!("import sys, transformers\nprint(transformers.AutoTokenizer.from_pretrained(sys.argv[1])('{first_doc}').input_ids)"), &[&hf]);
    let enc: Vec<u16> = serde_json::from_str(enc.trim()).unwrap();
    let val = std::fs::read(d.path().join("data/val_000000.bin")).unwrap();
    let shard: Vec<u16> =
        val[1024..].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).take(enc.len() + 1).collect();
    assert_eq!(enc[..], shard[..enc.len()]);
    assert_eq!(shard[enc.len()], 264, "EOS after the document");
    // Reading the export back (sample and init_from share the loader) is bit-exact.
    let back = logits(&hf, &d.path().join("back.safetensors"));
    assert!(l.equal(&back));
    reexport_keeps_the_directorys_special_tokens(&hf, d.path());
    let again = tg(&["export", run_dir.to_str().unwrap(), "--hf", hf.to_str().unwrap()]);
    assert_eq!(again.code(), 2, "an existing export is not overwritten");
    // Another model's directory (its config.json beside weights of another format) and a file.
    let other = d.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("config.json"), "{\"keep\": true}").unwrap();
    let file = d.path().join("file");
    std::fs::write(&file, "keep").unwrap();
    for (target, why) in [(&other, "already holds config.json"), (&file, "is a file, not a directory")] {
        let r = tg(&["export", run_dir.to_str().unwrap(), "--hf", target.to_str().unwrap()]);
        assert_eq!(r.code(), 2, "{}", r.stderr());
        assert!(r.stderr().contains(why), "{}", r.stderr());
    }
    assert_eq!(std::fs::read_to_string(other.join("config.json")).unwrap(), "{\"keep\": true}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
}

/// `hf`, a run's export (the EOS, 264, stands for the start and unknown tokens), edited to name
/// others as a transformers model's directory does: its re-export keeps them, each only as a token
/// the tokenizer has.
fn reexport_keeps_the_directorys_special_tokens(hf: &Path, root: &Path) {
    let json = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let write = |p: &Path, v: &serde_json::Value| {
        std::fs::write(p, serde_json::to_string_pretty(v).unwrap()).unwrap()
    };
    let (config, tc) = (json(&hf.join("config.json")), json(&hf.join("tokenizer_config.json")));
    assert_eq!((config["bos_token_id"].as_u64(), config["eos_token_id"].as_u64()), (Some(264), Some(264)));
    assert_eq!(
        (tc["bos_token"].as_str(), tc["unk_token"].as_str()),
        (Some("<|endoftext|>"), Some("<|endoftext|>"))
    );
    let tok = tokenizers::Tokenizer::from_file(hf.join("tokenizer.json")).unwrap();
    let (start, unknown) = (tok.id_to_token(100).unwrap(), tok.id_to_token(7).unwrap());
    let edit = |bos_id: serde_json::Value, bos: serde_json::Value, unk: &str| {
        let mut c = config.clone();
        c["bos_token_id"] = bos_id;
        write(&hf.join("config.json"), &c);
        let mut t = tc.clone();
        t["bos_token"] = bos;
        t["unk_token"] = serde_json::json!({"content": unk, "special": true});
        write(&hf.join("tokenizer_config.json"), &t);
    };
    let reexport = |name: &str| {
        let out = root.join(name);
        tg(&["export", hf.to_str().unwrap(), "--hf", out.to_str().unwrap()]).ok();
        let (c, g, t) = (
            json(&out.join("config.json")),
            json(&out.join("generation_config.json")),
            json(&out.join("tokenizer_config.json")),
        );
        let ids = |v: &serde_json::Value| (v["bos_token_id"].as_u64(), v["eos_token_id"].as_u64());
        assert_eq!(ids(&c), ids(&g), "{name}: config.json and generation_config.json agree");
        (
            ids(&c),
            t["bos_token"].as_str().map(str::to_string),
            t["unk_token"].as_str().map(str::to_string),
            out,
        )
    };
    // Both files name the start token, the unknown one by text: each kept.
    let json_null = serde_json::Value::Null;
    edit(serde_json::json!(100), serde_json::json!(start), &unknown);
    let (ids, bos, unk, out) = reexport("hf-kept");
    assert_eq!(
        (ids, bos.as_deref(), unk.as_deref()),
        ((Some(100), Some(264)), Some(start.as_str()), Some(unknown.as_str()))
    );
    let loaded = python("import sys, transformers\nt = transformers.AutoTokenizer.from_pretrained(sys.argv[1])\nprint(t.bos_token_id, t.eos_token_id, t.unk_token_id)", &[&out]);
    assert_eq!(loaded.trim(), "100 264 7", "transformers reads them back");
    // One file names it: the other follows from the tokenizer.
    edit(json_null.clone(), serde_json::json!(start), &unknown);
    assert_eq!(reexport("hf-by-text").0, (Some(100), Some(264)));
    edit(serde_json::json!(100), json_null.clone(), &unknown);
    assert_eq!(reexport("hf-by-id").1.as_deref(), Some(start.as_str()));
    // Tokens the tokenizer does not have: the EOS stands for them, as in a run's export.
    edit(serde_json::json!(100000), serde_json::json!("<nope>"), "<nope>");
    let (ids, bos, unk, _) = reexport("hf-unknown");
    assert_eq!(
        (ids, bos.as_deref(), unk.as_deref()),
        ((Some(264), Some(264)), Some("<|endoftext|>"), Some("<|endoftext|>"))
    );
    write(&hf.join("config.json"), &config);
    write(&hf.join("tokenizer_config.json"), &tc);
}

/// Saves the transformers model `constructor` builds (weights perturbed away from their init: biases
/// and norms away from 0 and 1) into `hf`, checks that trainguard reads it to the same logits,
/// and returns transformers' logits.
fn saved_by_transformers(hf: &Path, constructor: &str) -> tch::Tensor {
    let dir = hf.parent().unwrap();
    let ref_logits = dir.join("ref.safetensors");
    let script = format!(
        "
import sys, torch, transformers
from safetensors.torch import save_file
torch.manual_seed(0)
m = {constructor}.eval()
with torch.no_grad():
    for p in m.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    l = m(torch.tensor([[5,17,30,2,9,100,200,64]])).logits
m.save_pretrained(sys.argv[1])
save_file({{'logits': l.contiguous()}}, sys.argv[2])
"
    );
    python(&script, &[hf, &ref_logits]);
    let want = tch::Tensor::read_safetensors(&ref_logits).unwrap().remove(0).1;
    let direct = logits(hf, &dir.join("direct.safetensors"));
    let diff = (&direct - &want).abs().max().double_value(&[]);
    assert!(diff < 1e-4, "trainguard's logits differ from transformers' by {diff}");
    want
}

#[test]
fn a_model_saved_by_transformers_starts_training_with_init_from() {
    let d = tempfile::tempdir().unwrap();
    let hf = d.path().join("tiny");
    let want = saved_by_transformers(
        &hf,
        "transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=2, activation_function='gelu', resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))",
    );
    // Training from it: one step at a negligible learning rate leaves those logits in place.
    let init = format!("init_from={}", hf.display());
    let sets = [
        init.as_str(),
        "model.vocab_size=300",
        "model.n_embd=32",
        "model.seq_len=16",
        "train.max_steps=1",
        "train.warmup_steps=0",
        "train.lr=1e-12",
        "train.min_lr=0",
        "train.weight_decay=0",
    ];
    let out = d.path().join("run");
    train(&out, "configs/debug.yaml", &sets).ok();
    let trained = logits(&out, &d.path().join("trained.safetensors"));
    let diff = (&trained - &want).abs().max().double_value(&[]);
    assert!(diff < 1e-4, "after init_from the logits differ by {diff}");
    // GPT-2's own tanh approximation is let through, said once (the run reads config.json at
    // its check and again at the load).
    let cpath = hf.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
    c["activation_function"] = serde_json::json!("gelu_new");
    std::fs::write(&cpath, c.to_string()).unwrap();
    let r = train(&d.path().join("tanh"), "configs/debug.yaml", &sets).ok();
    assert_eq!(
        r.stderr().matches("activation_function gelu_new approximates the exact GELU").count(),
        1,
        "{}",
        r.stderr()
    );
    c["activation_function"] = serde_json::json!("gelu");
    std::fs::write(&cpath, c.to_string()).unwrap();
    // A model of another width: the tensor and both shapes are named, exit 2.
    let r = train(
        &d.path().join("bad"),
        "configs/debug.yaml",
        &[
            init.as_str(),
            "model.vocab_size=300",
            "model.n_embd=64",
            "model.seq_len=16",
            "train.max_steps=1",
            "train.warmup_steps=0",
        ],
    );
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr()
            .contains("`transformer.wte.weight` has shape [300, 32]; the model (its config) needs [300, 64]"),
        "{}",
        r.stderr()
    );
    // Refused before the run directory is touched: a benchmark's run there (no checkpoint, its
    // metrics its result) keeps its files as they were.
    let bench = d.path().join("bench");
    let quiet = ["checkpoint.interval=0", "checkpoint.at_end=false", "train.eval_interval=0"];
    train(&bench, "configs/debug.yaml", &[&sets[..], &quiet[..]].concat()).ok();
    let files = ["metrics.jsonl", "events.jsonl", "config.yaml", "stop.json"];
    let before: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(bench.join(f)).unwrap()).collect();
    let r = train(
        &bench,
        "configs/debug.yaml",
        &[
            &[
                init.as_str(),
                "model.vocab_size=300",
                "model.n_embd=64",
                "model.seq_len=16",
                "train.max_steps=1",
                "train.warmup_steps=0",
            ][..],
            &quiet[..],
        ]
        .concat(),
    );
    assert_eq!(r.code(), 2, "{}", r.stderr());
    for (f, b) in files.iter().zip(&before) {
        assert_eq!(&std::fs::read(bench.join(f)).unwrap(), b, "{f} changed by a refused run");
    }
    // With --overwrite too: refused before the old run is moved aside.
    let mut cmd = command(
        &bench,
        "configs/debug.yaml",
        &[
            &[
                init.as_str(),
                "model.vocab_size=300",
                "model.n_embd=64",
                "model.seq_len=16",
                "train.max_steps=1",
                "train.warmup_steps=0",
            ][..],
            &quiet[..],
        ]
        .concat(),
    );
    cmd.arg("--overwrite");
    let r = run(cmd, &bench);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    for (f, b) in files.iter().zip(&before) {
        assert_eq!(
            &std::fs::read(bench.join(f)).unwrap(),
            b,
            "{f} moved or changed by a refused --overwrite run"
        );
    }
    // Another head count fits every tensor's shape but computes another model: refused by key.
    let r = train(
        &d.path().join("heads"),
        "configs/debug.yaml",
        &[
            init.as_str(),
            "model.vocab_size=300",
            "model.n_embd=32",
            "model.n_head=4",
            "model.seq_len=16",
            "train.max_steps=1",
            "train.warmup_steps=0",
        ],
    );
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("gives n_head 2; the config's model.n_head is 4"), "{}", r.stderr());
    assert_eq!(r.stderr().matches("gives n_head 2").count(), 1, "said once: {}", r.stderr());
}

#[test]
fn a_llama_run_exports_to_llamaforcausallm_loads_back_bit_exact_and_samples() {
    let d = tempfile::tempdir().unwrap();
    let data = prepared(d.path());
    let run_dir = d.path().join("llama");
    let source = format!("data.source=tokens:{}", data.display());
    let sets = [
        &source,
        "model.vocab_size=265",
        "model.n_embd=32",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.ffn_hidden=48",
        "model.seq_len=16",
        "train.max_steps=5",
        "train.warmup_steps=1",
        "train.eval_interval=5",
    ];
    train(&run_dir, "configs/llama-debug.yaml", &sets).ok();
    let hf = d.path().join("hf");
    tg(&["export", run_dir.to_str().unwrap(), "--hf", hf.to_str().unwrap()]).ok();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (
            config["model_type"].as_str(),
            config["num_key_value_heads"].as_u64(),
            config["eos_token_id"].as_u64()
        ),
        (Some("llama"), Some(2), Some(264))
    );
    let ours = d.path().join("ours.safetensors");
    let l = logits(&run_dir, &ours);
    let diff: f64 =
        python(&TRANSFORMERS_LOGITS.replace("GPT2LMHeadModel", "LlamaForCausalLM"), &[&hf, &ours])
            .trim()
            .parse()
            .unwrap();
    assert!(diff < 1e-4, "transformers' logits differ by {diff}");
    // The export read back (the loader init_from uses too) gives the very same logits.
    assert!(l.equal(&logits(&hf, &d.path().join("back.safetensors"))));
    let s = |seed: &str| {
        tg(&[
            "sample",
            run_dir.to_str().unwrap(),
            "--prompt",
            "the cat",
            "--max-tokens",
            "20",
            "--seed",
            seed,
            "--device",
            "cpu",
        ])
        .ok()
        .stdout()
    };
    let (a, b, c) = (s("1"), s("1"), s("2"));
    assert!(!a.trim().is_empty());
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn a_llama_saved_by_transformers_gives_the_same_logits_and_starts_training_with_init_from() {
    let d = tempfile::tempdir().unwrap();
    let hf = d.path().join("tiny");
    let want = saved_by_transformers(
        &hf,
        "transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False))",
    );
    let init = format!("init_from={}", hf.display());
    let model = [
        "model.vocab_size=300",
        "model.n_embd=32",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.ffn_hidden=48",
        "model.seq_len=16",
        "model.rope_theta=500000",
        "model.norm_eps=1e-6",
        "model.tie_embeddings=false",
    ];
    let train_sets = [
        "train.max_steps=1",
        "train.warmup_steps=0",
        "train.lr=1e-12",
        "train.min_lr=0",
        "train.weight_decay=0",
    ];
    let sets: Vec<&str> = [init.as_str()].iter().chain(&model).chain(&train_sets).copied().collect();
    let out = d.path().join("run");
    train(&out, "configs/llama-debug.yaml", &sets).ok();
    let trained = logits(&out, &d.path().join("trained.safetensors"));
    let diff = (&trained - &want).abs().max().double_value(&[]);
    assert!(diff < 1e-4, "after init_from the logits differ by {diff}");
    // A tied model cannot take the untied head: the key and the value to set are named, exit 2.
    let tied: Vec<&str> = sets.iter().copied().filter(|s| !s.starts_with("model.tie")).collect();
    let r = train(&d.path().join("tied"), "configs/llama-debug.yaml", &tied);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains(
            "gives tie_embeddings false; the config's model.tie_embeddings is true: set it to false"
        ),
        "{}",
        r.stderr()
    );
    // Fewer blocks than the directory holds: the first left over is named with the key to change.
    let shallow: Vec<&str> = sets.iter().copied().chain(["model.n_layer=1"]).collect();
    let r = train(&d.path().join("shallow"), "configs/llama-debug.yaml", &shallow);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("has no place in the model: block 1 is beyond model.n_layer = 1"),
        "{}",
        r.stderr()
    );
    // Another RoPE base or norm epsilon fits every tensor but computes another model.
    for (key, set) in
        [("rope_theta 500000", "model.rope_theta=10000"), ("norm_eps 0.000001", "model.norm_eps=1e-5")]
    {
        let other: Vec<&str> = sets.iter().copied().chain([set]).collect();
        let r = train(&d.path().join(key.split(' ').next().unwrap()), "configs/llama-debug.yaml", &other);
        assert_eq!(r.code(), 2, "{}", r.stderr());
        assert!(r.stderr().contains(&format!("gives {key}")), "{}", r.stderr());
    }
    // RoPE scaling trainguard does not apply is refused, naming the key.
    let cpath = hf.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
    c["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0});
    std::fs::write(&cpath, c.to_string()).unwrap();
    let r = tg(&["sample", hf.to_str().unwrap(), "--ids", IDS, "--device", "cpu"]);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("`rope_scaling`"), "{}", r.stderr());
    // sample builds what config.json describes: under the rules and bounds of `model:` (a
    // context with extra digits asked libtorch for 40 TB and panicked), and with every tensor
    // placed (one block fewer silently dropped a block and printed another model's text).
    for (edit, needle) in [
        (
            serde_json::json!({"max_position_embeddings": 1_000_000_000_000u64}),
            "`max_position_embeddings` (model.seq_len): must be in 1..=4194304",
        ),
        (
            serde_json::json!({"rms_norm_eps": -1.0}),
            "`rms_norm_eps` (model.norm_eps): must be a positive number",
        ),
        (serde_json::json!({"rope_theta": "abc"}), "`rope_theta` is \"abc\", not a number"),
        (
            serde_json::json!({"num_hidden_layers": 1}),
            "has no place in the model: block 1 is beyond model.n_layer = 1",
        ),
    ] {
        let mut edited = c.clone();
        edited["rope_scaling"] = serde_json::Value::Null;
        edited.as_object_mut().unwrap().extend(edit.as_object().unwrap().clone());
        std::fs::write(&cpath, edited.to_string()).unwrap();
        let r = tg(&["sample", hf.to_str().unwrap(), "--ids", IDS, "--device", "cpu"]);
        assert_eq!(r.code(), 2, "{edit}: {}", r.stderr());
        assert!(r.stderr().contains(needle), "{edit}: {}", r.stderr());
    }
}
