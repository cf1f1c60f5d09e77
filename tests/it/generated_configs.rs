//! No config makes the process abort: many generated configs with extreme sizes (corpus length,
//! widths, vocabulary, sequence, batches, buckets, chunks) run through `trainguard train` under
//! an address-space cap, and each ends with a documented exit code and a message — never a Rust
//! allocation-failure abort, a panic or a backtrace. Sizes a config controls are checked before
//! they are allocated, or allocated fallibly.
use crate::common::*;
use std::os::unix::process::CommandExt;
use std::process::Stdio;

/// Values that are legal YAML for their key and absurd as sizes. (Not here: sizes that are only
/// slow — a global batch of 10^12 sequences is a valid, endless run; `batch::split` is lazy so it
/// costs no memory.)
const EXTREMES: &[(&str, &[&str])] = &[
    ("data.synthetic_tokens", &["1099511627776", "4611686018427387904"]),
    ("model.n_embd", &["1048576", "17179869184"]),
    ("model.n_layer", &["1048576"]),
    ("model.vocab_size", &["2147483647", "100000000"]),
    ("model.seq_len", &["1073741824"]),
    ("train.micro_batch_size", &["1099511627776"]),
    ("train.eval_batches", &["1099511627776"]),
    ("dist.bucket_mb", &["1.0e12"]),
    ("memory.loss_chunk_tokens", &["1", "1099511627776"]),
    ("checkpoint.keep_last", &["4611686018427387904"]),
    ("oom.min_micro_batch", &["1099511627776"]),
    ("model.ffn_hidden", &["68719476736"]),
];

#[test]
fn generated_configs_end_with_an_exit_code_never_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = 0x0000_ddc0_ffee_u64;
    let mut next = |n: usize| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((rng >> 33) as usize) % n
    };
    let mut cases: Vec<Vec<String>> =
        EXTREMES.iter().flat_map(|(k, vs)| vs.iter().map(move |v| vec![format!("{k}={v}")])).collect();
    for _ in 0..6 {
        let picks: Vec<String> = (0..2 + next(2))
            .map(|_| {
                let (k, vs) = EXTREMES[next(EXTREMES.len())];
                format!("{k}={}", vs[next(vs.len())])
            })
            .collect();
        cases.push(picks);
    }
    for (i, sets) in cases.iter().enumerate() {
        let out = dir.path().join(format!("c{i}"));
        let mut all: Vec<&str> = vec!["train.max_steps=1", "train.warmup_steps=0", "train.eval_interval=0"];
        all.extend(sets.iter().map(String::as_str));
        let mut cmd = command(&out, "configs/debug.yaml", &all);
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        // 8 GiB of address space: a size that is really allocated fails at once instead of
        // taking the machine's memory (libtorch itself maps ~3 GiB).
        unsafe {
            cmd.pre_exec(|| {
                let lim = libc::rlimit { rlim_cur: 8 << 30, rlim_max: 8 << 30 };
                libc::setrlimit(libc::RLIMIT_AS, &lim);
                Ok(())
            });
        }
        let output = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&output.stderr);
        let code = output.status.code();
        assert!(
            matches!(code, Some(0..=5)),
            "{sets:?}: ended by a signal or an undocumented code {:?}:\n{err}",
            output.status
        );
        for bad in ["panicked", "memory allocation of", "RUST_BACKTRACE", "stack backtrace"] {
            assert!(!err.contains(bad), "{sets:?}: `{bad}` in stderr:\n{err}");
        }
        if code != Some(0) {
            assert!(
                err.lines().any(|l| l.starts_with("error:")),
                "{sets:?}: exit {code:?} without an `error:` line:\n{err}"
            );
        }
    }
}
