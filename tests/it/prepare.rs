//! `trainguard prepare` and training on its output, on the real binary: shards match the Python
//! `tokenizers` package token for token, uint32 for large vocabularies, bad input exits 2 with
//! nothing left behind, and a run on a prepared directory resumes bit for bit.
use crate::common::*;
use crate::support::tokenizer;
use std::path::{Path, PathBuf};
use std::process::Command;

const WORDS: [&str; 16] = [
    "the", "cat", "sat", "on", "an", "inner", "mat", "and", "then", "ran", "after", "her", "dog", "in",
    "rain", "é",
];

/// `n` documents of pseudo-random sentences (fixed for a given `seed`).
fn documents(n: usize, seed: u64) -> Vec<String> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) as usize
    };
    (0..n)
        .map(|_| {
            let lines = 1 + next() % 3;
            (0..lines)
                .map(|_| {
                    (0..4 + next() % 8).map(|_| WORDS[next() % WORDS.len()]).collect::<Vec<_>>().join(" ")
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect()
}

struct Inputs {
    dir: tempfile::TempDir,
    docs: Vec<String>,
}

/// A tokenizer, a .txt of blank-line-separated documents and a .jsonl in a fresh directory.
fn inputs(n: usize, pad_vocab_to: usize) -> Inputs {
    let dir = tempfile::tempdir().unwrap();
    tokenizer::write(&dir.path().join("tokenizer.json"), pad_vocab_to);
    let docs = documents(n, 7);
    let (a, b) = docs.split_at(n / 2);
    std::fs::create_dir(dir.path().join("text")).unwrap();
    std::fs::write(dir.path().join("text/a.txt"), a.join("\n\n") + "\n").unwrap();
    let jsonl: String =
        b.iter().map(|d| serde_json::json!({"id": 1, "text": d}).to_string() + "\n").collect();
    std::fs::write(dir.path().join("text/b.jsonl"), jsonl).unwrap();
    Inputs { dir, docs }
}

fn prepare(inputs: &Path, out: &Path, extra: &[&str]) -> Run {
    let mut cmd = Command::new(bin());
    cmd.arg("prepare")
        .arg("--tokenizer")
        .arg(inputs.join("tokenizer.json"))
        .arg("--out")
        .arg(out)
        .arg(inputs.join("text"))
        .args(extra);
    run(cmd, out)
}

fn manifest(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("dataset.json")).unwrap()).unwrap()
}

/// All tokens of the shards `files` (val first, as the manifest lists them), headers checked.
fn shard_tokens(out: &Path, files: &[PathBuf]) -> Vec<u32> {
    let mut all = vec![];
    for f in files {
        let bytes = std::fs::read(out.join(f)).unwrap();
        let int = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
        let (width, n) = match (int(0), int(1)) {
            (20240520, 1) => (2, int(2) as usize),
            (20240801, 7) => (4, int(2) as usize),
            other => panic!("bad header {other:?}"),
        };
        assert_eq!(bytes.len(), 1024 + n * width);
        all.extend(bytes[1024..].chunks_exact(width).map(|c| {
            if width == 2 {
                u16::from_le_bytes([c[0], c[1]]) as u32
            } else {
                u32::from_le_bytes(c.try_into().unwrap())
            }
        }));
    }
    all
}

fn listed(m: &serde_json::Value) -> Vec<PathBuf> {
    ["val", "train"]
        .iter()
        .flat_map(|k| m[k].as_array().unwrap().iter().map(|s| PathBuf::from(s["file"].as_str().unwrap())))
        .collect()
}

/// Python `tokenizers`' ids for each document followed by EOS: the reference. Special tokens'
/// spellings in a document are ordinary text (`encode_special_tokens`), as `prepare` has them.
fn python_tokens(tokenizer: &Path, docs: &[String], eos: u32) -> Vec<u32> {
    let script = "import json,sys\nfrom tokenizers import Tokenizer\nt=Tokenizer.from_file(sys.argv[1])\nt.encode_special_tokens=True\ndocs=json.load(sys.stdin)\nprint(json.dumps([e.ids for e in t.encode_batch(docs, add_special_tokens=False)]))";
    let mut child = Command::new(repo().join(".venv/bin/python"))
        .args(["-c", script])
        .arg(tokenizer)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the venv's python (bash scripts/setup.sh installs tokenizers)");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(serde_json::to_string(docs).unwrap().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "python tokenizers failed: {}", String::from_utf8_lossy(&out.stderr));
    let ids: Vec<Vec<u32>> = serde_json::from_slice(&out.stdout).unwrap();
    ids.into_iter()
        .flat_map(|mut d| {
            d.push(eos);
            d
        })
        .collect()
}

#[test]
fn shards_hold_the_python_tokenizers_ids_with_eos_between_documents() {
    let inp = inputs(400, 0);
    let out = inp.dir.path().join("data");
    let r =
        prepare(inp.dir.path(), &out, &["--shard-tokens", "3000", "--val-tokens", "1000", "--threads", "2"])
            .ok();
    assert!(r.stdout().contains("400 documents"), "{}", r.stdout());
    let m = manifest(&out);
    assert_eq!(
        (m["dtype"].as_str(), m["vocab_size"].as_u64(), m["eos_id"].as_u64(), m["documents"].as_u64()),
        (Some("uint16"), Some(265), Some(264), Some(400))
    );
    assert_eq!(m["val"][0]["tokens"], 1000);
    let files = listed(&m);
    assert!(files.len() >= 4, "{files:?}");
    assert!(m["train"].as_array().unwrap().iter().rev().skip(1).all(|s| s["tokens"] == 3000));
    let got = shard_tokens(&out, &files);
    assert_eq!(got.len() as u64, m["train_tokens"].as_u64().unwrap() + 1000);
    let want = python_tokens(&out.join("tokenizer.json"), &inp.docs, 264);
    assert_eq!(got.len(), want.len());
    assert!(got == want, "token streams differ at {:?}", got.iter().zip(&want).position(|(a, b)| a != b));
    // The output does not depend on the thread count; a directory holding a dataset is refused.
    let out1 = inp.dir.path().join("data1");
    prepare(inp.dir.path(), &out1, &["--shard-tokens", "3000", "--val-tokens", "1000", "--threads", "1"])
        .ok();
    for f in files.iter().chain([&PathBuf::from("tokenizer.json")]) {
        assert_eq!(std::fs::read(out.join(f)).unwrap(), std::fs::read(out1.join(f)).unwrap(), "{f:?}");
    }
    let again = prepare(inp.dir.path(), &out, &[]);
    assert_eq!(again.code(), 2);
    assert!(again.stderr().contains("already holds a dataset"), "{}", again.stderr());
}

/// The EOS token's spelling inside a document is text, not the EOS id: a document quoting
/// `<|endoftext|>` is not split in two, and the EOS after each document is the real id.
#[test]
fn the_eos_tokens_spelling_inside_a_document_is_ordinary_text() {
    let d = tempfile::tempdir().unwrap();
    tokenizer::write(&d.path().join("tokenizer.json"), 0);
    let docs = [
        "Ada had a <|endoftext|> dog.".to_string(),
        "the<|endoftext|>cat\nsat <|endoftext|>".to_string(),
        "<|endoftext|>".to_string(),
    ];
    std::fs::create_dir(d.path().join("text")).unwrap();
    std::fs::write(d.path().join("text/a.txt"), docs[..2].join("\n\n") + "\n").unwrap();
    std::fs::write(d.path().join("text/b.jsonl"), serde_json::json!({"text": docs[2]}).to_string() + "\n")
        .unwrap();
    let out = d.path().join("data");
    prepare(d.path(), &out, &[]).ok();
    let got = shard_tokens(&out, &listed(&manifest(&out)));
    let eos_at: Vec<usize> = got.iter().enumerate().filter(|(_, &t)| t == 264).map(|(i, _)| i).collect();
    assert_eq!(eos_at.len(), docs.len(), "one EOS per document, none inside one: {got:?}");
    assert_eq!(eos_at.last(), Some(&(got.len() - 1)));
    assert_eq!(got, python_tokens(&out.join("tokenizer.json"), &docs, 264));
}

/// A JSONL string with an unpaired surrogate escape, as Python's `json.dumps` writes one, is
/// read with U+FFFD in its place and counted in a warning naming the file; the corpus goes on.
#[test]
fn a_lone_surrogate_escape_in_jsonl_is_read_as_u_fffd_with_a_warning() {
    let d = tempfile::tempdir().unwrap();
    tokenizer::write(&d.path().join("tokenizer.json"), 0);
    std::fs::create_dir(d.path().join("text")).unwrap();
    std::fs::write(
        d.path().join("text/s.jsonl"),
        "{\"text\":\"the cat\"}\n{\"text\":\"a\\ud800b\"}\n{\"text\":\"\\ud83d\\ude00 \\udc00\"}\n",
    )
    .unwrap();
    let out = d.path().join("data");
    let r = prepare(d.path(), &out, &[]).ok();
    assert!(
        r.stderr().contains("s.jsonl: 2 line(s) hold an unpaired UTF-16 surrogate escape")
            && r.stderr().contains(r"`\ud800` at line 2"),
        "{}",
        r.stderr()
    );
    let docs = ["the cat".to_string(), "a\u{fffd}b".to_string(), "\u{1f600} \u{fffd}".to_string()];
    assert_eq!(
        shard_tokens(&out, &listed(&manifest(&out))),
        python_tokens(&out.join("tokenizer.json"), &docs, 264)
    );
}

/// A file of single-newline lines is one document: one of 2.5 MB is tokenized in pieces (a
/// whole 40 MB one had needed 5 GB of memory), with the ids of the whole document, and the peak
/// memory of one of 10 MB stays far below the tokenizer's ~130 bytes per byte of a whole one.
#[test]
fn a_long_document_has_the_ids_of_the_whole_and_bounded_memory() {
    let d = tempfile::tempdir().unwrap();
    tokenizer::write(&d.path().join("tokenizer.json"), 0);
    let mut doc = String::new();
    for para in documents(60_000, 3) {
        doc.push_str(&para);
        doc.push('\n');
        if doc.len() > 2_500_000 {
            break;
        }
    }
    let doc = doc.trim_end().to_string();
    std::fs::create_dir(d.path().join("text")).unwrap();
    std::fs::write(d.path().join("text/one.txt"), &doc).unwrap();
    let out = d.path().join("data");
    let r = prepare(d.path(), &out, &["--threads", "1"]).ok();
    assert!(r.stdout().contains("1 documents"), "{}", r.stdout());
    let got = shard_tokens(&out, &listed(&manifest(&out)));
    let want = python_tokens(&out.join("tokenizer.json"), std::slice::from_ref(&doc), 264);
    assert!(
        got == want,
        "{} tokens, {} expected; first difference at {:?}",
        got.len(),
        want.len(),
        got.iter().zip(&want).position(|(a, b)| a != b)
    );
    // Peak resident memory of the child (Linux's VmHWM is the process's own; the children's
    // rusage maximum covers every test's children, so a fresh process under /usr/bin/time -f).
    let time = std::path::Path::new("/usr/bin/time");
    if !time.exists() {
        eprintln!("skipped the memory check: no /usr/bin/time");
        return;
    }
    let peak_mib = |text: &Path, out: &str| -> u64 {
        let o = Command::new(time)
            .args(["-f", "%M"])
            .arg(bin())
            .args(["prepare", "--threads", "1", "--tokenizer"])
            .arg(d.path().join("tokenizer.json"))
            .arg("--out")
            .arg(d.path().join(out))
            .arg(text)
            .output()
            .unwrap();
        let kib: u64 = String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("{}", String::from_utf8_lossy(&o.stderr)));
        kib / 1024
    };
    // The binary's own (libtorch's pages), with a 10 kB corpus, against one document four times
    // as long as the one above (10 MB): whole, the tokenizer's ~130 bytes per byte would be
    // ~1.2 GiB above it.
    let small: String = doc.chars().take(10_000).collect();
    std::fs::write(d.path().join("small.txt"), small).unwrap();
    std::fs::create_dir(d.path().join("long")).unwrap();
    std::fs::write(d.path().join("long/one.txt"), [doc.as_str(); 4].join("\n")).unwrap();
    let (base, peak) =
        (peak_mib(&d.path().join("small.txt"), "data2"), peak_mib(&d.path().join("long"), "data3"));
    eprintln!("peak {peak} MiB for a {:.1} MB document, {base} MiB for 10 kB", 4.0 * doc.len() as f64 / 1e6);
    // In pieces the peak does not grow with the length: +232 MiB above the 10 kB run for 2.5 MB,
    // +240 MiB for 10 MB. (Since commands end by `_exit`, the 10 kB run no longer counts the
    // ~118 MiB of pages the libraries' clean-up at `exit` touched, which the bound once leaned on.)
    assert!(peak < base + 400, "peak {peak} MiB, {base} MiB for 10 kB");
}

/// Text without whitespace (a 21 MB one-line document) is cut into pieces at character
/// boundaries: under a memory limit it succeeds with every token written. Whole, the tokenizer
/// needed ~180 bytes per byte of it (3.8 GB) and aborted at the limit with a backtrace.
#[test]
fn text_without_whitespace_is_tokenized_within_a_memory_limit() {
    let prlimit = Path::new("/usr/bin/prlimit");
    if !prlimit.exists() {
        eprintln!("skipped: no /usr/bin/prlimit");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    tokenizer::write(&d.path().join("tokenizer.json"), 0);
    // `a` and `é` (bytes 0xC3 0xA9): no merge joins them, so a piece's ids are the whole's.
    let n = 7_000_000;
    std::fs::create_dir(d.path().join("text")).unwrap();
    std::fs::write(d.path().join("text/one.txt"), "aé".repeat(n)).unwrap();
    let out = d.path().join("data");
    let mut cmd = Command::new(prlimit);
    // Private writable memory (the heap; not libtorch's mapped files, which vary by build).
    cmd.arg(format!("--data={}", MEMORY_LIMIT_MIB << 20))
        .arg(bin())
        .args(["prepare", "--threads", "2", "--tokenizer"])
        .arg(d.path().join("tokenizer.json"))
        .arg("--out")
        .arg(&out)
        .arg(d.path().join("text"));
    let r = run(cmd, &out);
    assert_eq!(r.code(), 0, "under a {MEMORY_LIMIT_MIB} MiB data limit:\n{}", r.stderr());
    assert!(r.stderr().contains("20 cut(s) in long documents"), "{}", r.stderr());
    let got = shard_tokens(&out, &listed(&manifest(&out)));
    assert_eq!(got.len(), 3 * n + 1);
    assert!(got[..3 * n].chunks(3).all(|c| c == [97, 195, 169]) && got[3 * n] == 264);
}

/// The `--data` limit above: the binary needs ~0.6 GiB of it (CUDA libtorch's loader) and ~1.1
/// GiB at most with two threads in pieces; whole, ~3.8 GB.
const MEMORY_LIMIT_MIB: u64 = 2048;

#[test]
fn large_vocabularies_give_uint32_shards_that_train() {
    let inp = inputs(300, 70_000);
    let out = inp.dir.path().join("data");
    prepare(inp.dir.path(), &out, &["--val-tokens", "800"]).ok();
    let m = manifest(&out);
    assert_eq!(
        (m["dtype"].as_str(), m["header_magic"].as_i64(), m["eos_id"].as_u64()),
        (Some("uint32"), Some(20240801), Some(69_999))
    );
    let got = shard_tokens(&out, &listed(&m));
    assert_eq!(got, python_tokens(&out.join("tokenizer.json"), &inp.docs, 69_999));
    let run_dir = inp.dir.path().join("run");
    let source = format!("data.source=tokens:{}", out.display());
    let small = [
        "model.n_embd=16",
        "model.seq_len=16",
        "train.max_steps=3",
        "train.warmup_steps=1",
        "train.eval_interval=3",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
    ];
    let sets: Vec<&str> = small.iter().copied().chain([source.as_str(), "model.vocab_size=70000"]).collect();
    let r = train(&run_dir, "configs/debug.yaml", &sets).ok();
    assert_eq!(r.metrics().len(), 3);
    // One token id short of the data's vocabulary: refused before training, exit 2.
    let sets: Vec<&str> = small.iter().copied().chain([source.as_str(), "model.vocab_size=69999"]).collect();
    let r = train(&inp.dir.path().join("run2"), "configs/debug.yaml", &sets);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains("model.vocab_size = 69999") && r.stderr().contains("at least 70000"),
        "{}",
        r.stderr()
    );
}

#[test]
fn bad_input_names_file_and_line_exits_2_and_leaves_no_shard() {
    let inp = inputs(50, 0);
    let d = inp.dir.path();
    std::fs::write(
        d.join("text/c.jsonl"),
        "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n",
    )
    .unwrap();
    let out = d.join("data");
    let r = prepare(d, &out, &["--shard-tokens", "10"]);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("c.jsonl:3") && r.stderr().contains("no field `text`"), "{}", r.stderr());
    assert!(!out.exists(), "the output directory it created is removed");
    std::fs::remove_file(d.join("text/c.jsonl")).unwrap();
    std::fs::write(d.join("text/z.txt"), b"fine\n\nbad \xff byte\n").unwrap();
    std::fs::create_dir(&out).unwrap();
    let r = prepare(d, &out, &["--shard-tokens", "10"]);
    assert_eq!(r.code(), 2);
    assert!(r.stderr().contains("z.txt:3") && r.stderr().contains("invalid UTF-8"), "{}", r.stderr());
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        0,
        "no shard, manifest or staging left in an existing directory"
    );
    std::fs::remove_file(d.join("text/z.txt")).unwrap();
    std::fs::write(d.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let r = prepare(d, &out, &[]);
    assert_eq!(r.code(), 2);
    assert!(r.stderr().contains("not a valid tokenizer.json"), "{}", r.stderr());
}

/// SIGINT (or SIGTERM) stops `prepare` between chunks and removes what it wrote: exit 4, no
/// staging directory, and the output directory it created is gone. Staging left by a prepare
/// that was killed (its pid has no process) is removed by the next one into that directory.
#[test]
fn an_interrupted_prepare_leaves_nothing_and_abandoned_staging_is_removed() {
    let inp = inputs(10, 0);
    let d = inp.dir.path();
    // ~48 MB: long enough on one thread that the signal lands while chunks are tokenized.
    let big = documents(2000, 3).join("\n\n") + "\n\n";
    std::fs::write(d.join("text/big.txt"), big.repeat((48 << 20) / big.len() + 1)).unwrap();
    let out = d.join("data");
    let child = Command::new(bin())
        .args(["prepare", "--threads", "1", "--tokenizer"])
        .arg(d.join("tokenizer.json"))
        .arg("--out")
        .arg(&out)
        .arg(d.join("text"))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let staging = out.join(format!(".prepare-tmp-{}", child.id()));
    let started = std::time::Instant::now();
    while !staging.join("train_000000.bin").exists() {
        assert!(started.elapsed().as_secs() < 60, "prepare never started writing");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let done = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("interrupted: nothing was kept"), "{stderr}");
    assert!(!out.exists(), "the directory it created is removed with the staging");

    std::fs::remove_file(d.join("text/big.txt")).unwrap();
    let abandoned = out.join(".prepare-tmp-4294967");
    std::fs::create_dir_all(&abandoned).unwrap();
    std::fs::write(abandoned.join("train_000000.bin"), [0u8; 64]).unwrap();
    prepare(d, &out, &[]).ok();
    assert!(!abandoned.exists(), "a killed prepare's staging is removed");
    assert!(out.join("dataset.json").is_file());
}

#[test]
fn training_on_a_prepared_directory_resumes_bit_for_bit() {
    let inp = inputs(1500, 0);
    let out = inp.dir.path().join("data");
    prepare(inp.dir.path(), &out, &["--shard-tokens", "8000", "--val-tokens", "2000"]).ok();
    let source = format!("data.source=tokens:{}", out.display());
    let base = [
        "model.vocab_size=265",
        "model.seq_len=32",
        "train.max_steps=12",
        "train.warmup_steps=2",
        "train.eval_interval=6",
        "checkpoint.interval=6",
        "model.dropout=0.1",
    ];
    let sets = |extra: &[&'static str]| -> Vec<String> {
        base.iter()
            .map(|s| s.to_string())
            .chain([source.clone()])
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    let (a, b) = (inp.dir.path().join("a"), inp.dir.path().join("b"));
    let straight_sets = sets(&[]);
    let straight =
        train(&a, "configs/debug.yaml", &straight_sets.iter().map(String::as_str).collect::<Vec<_>>()).ok();
    assert!(
        straight.events_of("run_started")[0]["corpus"].as_str().unwrap().contains("files"),
        "{:?}",
        straight.events_of("run_started")
    );
    let first_sets = sets(&["faults.interrupt_at_step=6"]);
    let first = train(&b, "configs/debug.yaml", &first_sets.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(first.code(), 4, "{}", first.stderr());
    let mut cmd =
        command(&b, "configs/debug.yaml", &straight_sets.iter().map(String::as_str).collect::<Vec<_>>());
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, &b).ok();
    for key in ["loss", "grad_norm", "val_loss"] {
        assert_eq!(series(&straight.metrics(), key), series(&resumed.metrics(), key), "{key} differs");
    }
    assert_eq!(max_weight_diff(&a, &b), 0.0);
    // The validation split is the val shard: its loss is reported, and the model learned.
    let losses = series(&straight.metrics(), "loss");
    assert!(losses.last().unwrap().as_f64().unwrap() < losses[0].as_f64().unwrap() - 1.0, "{losses:?}");
    // A model whose embedding is smaller than the tokenizer's vocabulary is refused (exit 2).
    let small =
        train(&inp.dir.path().join("c"), "configs/debug.yaml", &[source.as_str(), "model.vocab_size=256"]);
    assert_eq!(small.code(), 2, "{}", small.stderr());
}

/// `prepare --tokenizer T --out OUT FILES…`, run to its end.
fn prepare_files(tokenizer: &Path, out: &Path, files: &[&Path]) -> Run {
    let mut cmd = Command::new(bin());
    cmd.arg("prepare").arg("--tokenizer").arg(tokenizer).arg("--out").arg(out).args(files);
    run(cmd, out)
}

/// A `prepare` still running, killed if the test fails before it is done with it.
struct Waiting(Option<std::process::Child>);

impl Waiting {
    fn id(&self) -> u32 {
        self.0.as_ref().expect("running").id()
    }
    fn finish(mut self) -> std::process::Output {
        self.0.take().expect("running").wait_with_output().unwrap()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts a `prepare` of `input` into `out` and waits until it holds `out` (its staging
/// directory is made after the lock is taken and the directory checked).
fn prepare_waiting_on(tokenizer: &Path, out: &Path, input: &Path) -> Waiting {
    let child = Command::new(bin())
        .arg("prepare")
        .arg("--tokenizer")
        .arg(tokenizer)
        .arg("--out")
        .arg(out)
        .arg(input)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let staging = out.join(format!(".prepare-tmp-{}", child.id()));
    let child = Waiting(Some(child));
    let started = std::time::Instant::now();
    while !staging.is_dir() {
        assert!(started.elapsed().as_secs() < 60, "prepare never started writing {}", out.display());
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child
}

/// Text of `documents` short documents: several seconds of tokenizing, a window in which a
/// `prepare` holds its `--out`. (A pipe held it open before; `prepare` reads regular files only.)
fn long_input(path: &Path, documents: usize) {
    let text: String = (0..documents).map(|i| format!("the cat sat on the mat, number {i}\n\n")).collect();
    std::fs::write(path, text).unwrap();
}

fn signal(child: &Waiting, sig: i32) {
    // SAFETY: a plain kill(2) of a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

/// Two `prepare`s into one `--out`: the second, started while the first writes, is refused
/// (exit 2, naming the directory and the holder), and the first's dataset is the one kept;
/// the check at the start alone let the one finishing last rename its dataset over the
/// other's. A `prepare` killed with SIGKILL holds nothing: the next one goes ahead.
#[test]
fn a_second_prepare_into_a_directory_being_written_is_refused() {
    let inp = inputs(10, 0);
    let d = inp.dir.path();
    let tok = d.join("tokenizer.json");
    let (long, out) = (d.join("long.txt"), d.join("data"));
    long_input(&long, 400_000);
    let first = prepare_waiting_on(&tok, &out, &long);
    // Held still while the second tries: it cannot finish first by chance.
    signal(&first, libc::SIGSTOP);
    let second = prepare(d, &out, &[]);
    signal(&first, libc::SIGCONT);
    assert_eq!(second.code(), 2, "{}", second.stderr());
    let e = second.stderr();
    assert!(
        e.contains(&format!(
            "{}: another prepare is writing this directory (pid {} on ",
            out.display(),
            first.id()
        )),
        "{e}"
    );
    let done = first.finish();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert_eq!(
        manifest(&out)["documents"],
        400_000,
        "the first prepare's dataset, not the second's 10 documents"
    );
    let mut left: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !["tokenizer.json", "dataset.json"].contains(&n.as_str()) && !n.ends_with(".bin"))
        .collect();
    left.sort();
    assert!(left.is_empty(), "no lock file or staging left: {left:?}");

    let out = d.join("data2");
    let killed = prepare_waiting_on(&tok, &out, &long);
    let pid = killed.id();
    signal(&killed, libc::SIGKILL);
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&killed.finish().status), Some(libc::SIGKILL));
    prepare(d, &out, &[]).ok();
    assert_eq!(manifest(&out)["documents"], 10);
    assert!(!out.join(format!(".prepare-tmp-{pid}")).exists(), "the killed one's staging is removed");
}

/// A `tokenizer.json` already in `--out` (the user's own) is not replaced by the copy of
/// `--tokenizer`: refused (exit 2, naming it) and left as it was, unless it is the same bytes.
#[test]
fn a_tokenizer_json_in_out_other_than_the_tokenizer_is_refused_and_kept() {
    let inp = inputs(10, 0);
    let d = inp.dir.path();
    let out = d.join("data");
    std::fs::create_dir(&out).unwrap();
    let theirs = "{\"theirs\": true}\n";
    std::fs::write(out.join("tokenizer.json"), theirs).unwrap();
    let r = prepare(d, &out, &[]);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains(&format!(
            "{}: already exists and differs from --tokenizer",
            out.join("tokenizer.json").display()
        )),
        "{}",
        r.stderr()
    );
    assert_eq!(std::fs::read_to_string(out.join("tokenizer.json")).unwrap(), theirs);
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1, "nothing else left");
    std::fs::copy(d.join("tokenizer.json"), out.join("tokenizer.json")).unwrap();
    prepare(d, &out, &[]).ok();
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(d.join("tokenizer.json")).unwrap()
    );
}

/// A prepare that wrote its dataset exits 0 even when its summary line cannot be printed
/// (stdout on a full disk): exit 1 would send a job script's retry into "already holds a
/// dataset". Stderr says where the dataset is.
#[test]
fn a_prepare_whose_summary_cannot_be_printed_still_succeeds() {
    let inp = inputs(10, 0);
    let d = inp.dir.path();
    let out = d.join("data");
    let mut cmd = Command::new(bin());
    cmd.arg("prepare")
        .arg("--tokenizer")
        .arg(d.join("tokenizer.json"))
        .arg("--out")
        .arg(&out)
        .arg(d.join("text"));
    cmd.stdout(std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap());
    let r = run(cmd, &out);
    assert_eq!(r.code(), 0, "{}", r.stderr());
    assert!(
        r.stderr().contains(&format!("the dataset was written at {}", out.display()))
            && r.stderr().contains("No space left on device"),
        "{}",
        r.stderr()
    );
    assert_eq!(manifest(&out)["documents"], 10);
}

/// A failed prepare removes every directory it created on the way to `--out`, and only those.
#[test]
fn a_failed_prepare_removes_the_parents_it_created() {
    let d = tempfile::tempdir().unwrap();
    let tok = d.path().join("tokenizer.json");
    tokenizer::write(&tok, 0);
    let blank = d.path().join("blank.txt");
    std::fs::write(&blank, "\n  \n\n").unwrap();
    std::fs::create_dir(d.path().join("kept")).unwrap();
    for out in ["newp/q/r", "kept/q/r"] {
        let r = prepare_files(&tok, &d.path().join(out), &[&blank]);
        assert_eq!(r.code(), 2, "{}", r.stderr());
        assert!(r.stderr().contains("the inputs give 0 tokens"), "{}", r.stderr());
    }
    assert!(!d.path().join("newp").exists(), "newp, newp/q and newp/q/r were this prepare's");
    assert!(d.path().join("kept").is_dir() && !d.path().join("kept/q").exists(), "only what it created");
}
