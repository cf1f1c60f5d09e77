//! `model.pad_vocab_to` on the real binary: a run with the vocabulary padded (300 tokens → 320
//! rows) trains like the same run unpadded (GPT-2 with the chunked loss, an untied Llama), its
//! padded rows stay exactly zero (under AdamW's weight decay too), Adafactor's per-tensor
//! statistics ignore them, it resumes bitwise from a checkpoint, sampling never emits a padded
//! id, export writes the user's vocabulary and loads back to the same logits, and a bad value is
//! a config error naming the key.
use crate::common::*;
use std::path::Path;
use std::process::Command;
use tch::Tensor;

const VOCAB: i64 = 300;
const SHORT: [&str; 5] = [
    "model.vocab_size=300",
    "train.max_steps=12",
    "train.warmup_steps=2",
    "train.eval_interval=6",
    "train.log_interval=1",
];

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SHORT.iter().chain(extra).copied().collect()
}

fn tg(args: &[&str]) -> Run {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    run(cmd, Path::new("."))
}

/// The padded run's weights against the unpadded run's: every tensor's user rows within `tol`
/// and the padded rows exactly zero.
fn assert_same_model(padded: &Path, plain: &Path, tol: f64) {
    let (wa, wb) = (weights(padded), weights(plain));
    assert_eq!(wa.len(), wb.len());
    let mut padded_tensors = 0;
    for ((na, a), (nb, b)) in wa.iter().zip(&wb) {
        assert_eq!(na, nb);
        let rows = b.size()[0];
        if a.size() != b.size() {
            assert_eq!((a.size()[0], rows), (320, VOCAB), "{na}");
            padded_tensors += 1;
            let pad = a.narrow(0, rows, 320 - rows).abs().max().double_value(&[]);
            assert_eq!(pad, 0.0, "{na}: padded rows must stay exactly zero after training");
        }
        let d = (a.narrow(0, 0, rows) - b).abs().max().double_value(&[]);
        assert!(d < tol, "{na}: the user rows differ by {d:e}");
    }
    assert!(padded_tensors >= 1);
}

fn losses(r: &Run) -> Vec<f64> {
    r.metrics().iter().map(|m| m["loss"].as_f64().unwrap()).collect()
}

/// `tol`: the weights' bound. The padded GEMMs round a few last bits differently (matrix
/// widths 320 vs 300 block differently); SGD passes that on as it is (1e-6), AdamW's first steps
/// divide each gradient by its own magnitude, so elements with |g| near eps (attention's q and k
/// gradients at a near-uniform start) move by up to lr × a relative difference: 3.2e-6 measured
/// after 12 steps, as between any two GEMM kernels.
fn assert_same_run(config: &str, extra: &[&str], tol: f64) {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let padded = train(a.path(), config, &with(extra)).ok();
    let plain = train(b.path(), config, &with(&[extra, &["model.pad_vocab_to=1"]].concat())).ok();
    let (la, lb) = (losses(&padded), losses(&plain));
    assert_eq!(la.len(), 12);
    for (step, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert!((x - y).abs() < 1e-6, "{config} step {step}: loss {x} padded vs {y}");
    }
    assert!(la[11] < la[0] - 0.01, "the run learns: {la:?}");
    assert_same_model(a.path(), b.path(), tol);
}

#[test]
fn a_padded_gpt2_with_the_chunked_loss_trains_like_the_unpadded_one() {
    assert_same_run(
        "configs/debug.yaml",
        &["memory.loss_chunk_tokens=100", "optimizer.name=sgd", "train.lr=0.3"],
        1e-6,
    );
}

#[test]
fn a_padded_untied_llama_trains_like_the_unpadded_one() {
    // AdamW (the default): the untied lm_head has weight decay, its zero rows must stay zero.
    assert_same_run("configs/llama-debug.yaml", &["model.tie_embeddings=false"], 2e-5);
}

#[test]
fn adafactor_sees_the_unpadded_tensors() {
    // Its update clipping and relative step size use each tensor's RMS: the optimizer gets the
    // user rows only, so the padding does not dilute them (7.7e-4 apart in loss when it did).
    assert_same_run("configs/debug.yaml", &["optimizer.name=adafactor"], 1e-5);
}

#[test]
fn a_padded_run_resumes_bitwise() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = train(a.path(), "configs/debug.yaml", &with(&["checkpoint.interval=6"])).ok();
    let first = train(
        b.path(),
        "configs/debug.yaml",
        &with(&["checkpoint.interval=6", "faults.interrupt_at_step=6"]),
    );
    assert_eq!(first.code(), 4, "{}", first.stderr());
    let mut cmd = command(b.path(), "configs/debug.yaml", &with(&["checkpoint.interval=6"]));
    cmd.args(["--resume", "auto"]);
    let resumed = run(cmd, b.path()).ok();
    assert_eq!(resumed.events_of("resumed")[0]["step"], 6);
    assert_eq!(series(&straight.metrics(), "loss"), series(&resumed.metrics(), "loss"));
    assert_bitwise_equal(&a.path().join("model.safetensors"), &b.path().join("model.safetensors"));
    assert_eq!(
        weights(a.path()).iter().find(|(n, _)| n == "wte.weight").unwrap().1.size(),
        [320, 64],
        "checkpoints hold the padded rows"
    );
}

/// A checkpoint written before `model.pad_vocab_to` existed: its config.yaml lacks the key (so
/// reads the default padding), its vocabulary matrices have the user's rows. The resume names
/// the change instead of calling the checkpoint corrupt or copying rows that do not fit.
#[test]
fn a_checkpoint_from_before_the_padding_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    train(
        dir.path(),
        "configs/debug.yaml",
        &with(&["model.pad_vocab_to=1", "train.max_steps=6", "checkpoint.interval=6"]),
    )
    .ok();
    let saved = dir.path().join("checkpoints/step-00000006/config.yaml");
    let text = std::fs::read_to_string(&saved).unwrap();
    let older: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("pad_vocab_to:"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(older.lines().count() + 1, text.lines().count(), "one line taken out");
    std::fs::write(&saved, older).unwrap();
    let mut cmd = command(dir.path(), "configs/debug.yaml", &with(&[]));
    cmd.args(["--resume", "auto"]);
    let r = run(cmd, dir.path());
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(
        r.stderr().contains(
            "model.pad_vocab_to: checkpoint 1 (`wte.weight` has the unpadded [300, 64]), config 64"
        ),
        "{}",
        r.stderr()
    );
}

#[test]
fn sampling_never_emits_a_padded_id_and_export_keeps_the_users_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    // A bare token file (no tokenizer): `sample` reads and prints token ids.
    let tokens: Vec<u16> = (0..20_000u32).map(|i| ((i * 7919) % VOCAB as u32) as u16).collect();
    let file = dir.path().join("train.bin");
    std::fs::write(&file, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let source = format!("data.source=tokens:{}", file.display());
    let out = dir.path().join("run");
    train(&out, "configs/debug.yaml", &with(&[&source])).ok();
    // The padded rows are zero, so unmasked their logits (0) would beat about half the user's;
    // at a high temperature every id that is in the distribution turns up within 400 draws.
    let r = tg(&[
        "sample",
        out.to_str().unwrap(),
        "--prompt",
        "1 2 3",
        "--max-tokens",
        "400",
        "--temperature",
        "50",
        "--device",
        "cpu",
    ])
    .ok();
    let ids: Vec<i64> = r.stdout().split_whitespace().map(|w| w.parse().unwrap()).collect();
    assert_eq!(ids.len(), 400, "{}", r.stdout());
    assert!(
        ids.iter().all(|&i| (0..VOCAB).contains(&i)),
        "a padded id was sampled: {:?}",
        ids.iter().filter(|&&i| i >= VOCAB).collect::<Vec<_>>()
    );
    assert!(ids.iter().any(|&i| i >= 250), "the draw covers the top of the vocabulary");

    // Export: transformers' shapes and vocab_size are the user's.
    let hf = dir.path().join("hf");
    tg(&["export", out.to_str().unwrap(), "--hf", hf.to_str().unwrap()]).ok();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["vocab_size"], VOCAB);
    let exported = tensors(&hf.join("model.safetensors"));
    assert_eq!(exported.iter().find(|(n, _)| n == "transformer.wte.weight").unwrap().1.size(), [VOCAB, 64]);
    // Loaded back (padded again on import): the same logits, over the user's vocabulary.
    let dump = |target: &Path, name: &str| -> Tensor {
        let f = dir.path().join(name);
        tg(&[
            "sample",
            target.to_str().unwrap(),
            "--ids",
            "5,17,299,2",
            "--device",
            "cpu",
            "--dump-logits",
            f.to_str().unwrap(),
        ])
        .ok();
        Tensor::read_safetensors(&f).unwrap().remove(0).1
    };
    let (ours, back) = (dump(&out, "a.safetensors"), dump(&hf, "b.safetensors"));
    assert_eq!(ours.size(), [1, 4, VOCAB]);
    assert!(ours.equal(&back), "export → import changed the logits");
}

#[test]
fn a_bad_pad_vocab_to_is_a_config_error_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let r = train(dir.path(), "configs/debug.yaml", &["model.pad_vocab_to=0"]);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("model.pad_vocab_to: must be in 1..=65536"), "{}", r.stderr());
    assert!(!r.stderr().contains("panicked"), "{}", r.stderr());
    let r = train(dir.path(), "configs/debug.yaml", &["model.pad_vocab_to=-3"]);
    assert_eq!(r.code(), 2, "{}", r.stderr());
    assert!(r.stderr().contains("model.pad_vocab_to"), "{}", r.stderr());
}
