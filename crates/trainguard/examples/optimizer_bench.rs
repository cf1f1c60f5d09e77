//! The optimizer tables in BENCHMARKS.md, printed (not asserted: the tests in
//! tests/it/optimizers.rs pin the behaviour).
//!
//! - `cargo run --release -p trainguard --example optimizer_bench -- state`: each optimizer's
//!   state bytes for the debug model and GPT-2 124M (built on the CPU: ~0.5 GB of weights), with
//!   the planner's estimate and the update's scratch.
//! - `cargo run --release -p trainguard --example optimizer_bench -- update`: one update of each
//!   optimizer, timed alone (no forward or backward) on a model's real parameters, against fused
//!   AdamW in the same process; median of `STEPS` (default 10) updates after 2 warm-up ones.
//!   `scripts/bench/bench_optimizers.sh [--device cuda] [config.yaml]` runs it
//!   (`TG_BENCH_DEVICE`, `TG_BENCH_CONFIG`; default the CPU and configs/gpt2-124m.yaml).
use tch::{Device, Tensor};
use trainguard::config::{ModelConfig, OptimizerName};
use trainguard::model::Model;
use trainguard::optim::{Optimizer, OptimizerSpec};
use trainguard::planner::optimizer_state::StateBytes;

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("state") => print_state_bytes(),
        Some("update") | None => print_update_time(),
        Some(other) => {
            eprintln!("optimizer_bench: expected `state` or `update`, got `{other}`");
            std::process::exit(2);
        }
    }
}

fn print_state_bytes() {
    let gpt2 = ModelConfig {
        n_layer: 12,
        n_head: 12,
        n_embd: 768,
        vocab_size: 50257,
        seq_len: 1024,
        dropout: 0.0,
        bias: true,
        ..ModelConfig::default()
    };
    for (label, model) in [("debug", ModelConfig::default()), ("gpt2-124m", gpt2)] {
        let rows =
            trainguard::planner::optimizer_state::measure(&model).expect("the model builds on the CPU");
        let adamw = rows[0].measured as f64;
        for StateBytes { kind, measured: bytes, estimate, scratch } in rows {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            println!(
                "{label:10} {kind:13} {bytes:>12} bytes  {:7.1} MiB  {:5.1} % of adamw  (planner: {estimate})  scratch {:.1} KiB",
                mib(bytes),
                100.0 * bytes as f64 / adamw,
                scratch as f64 / 1024.0
            );
        }
    }
}

fn print_update_time() {
    use std::time::Instant;
    let device = match std::env::var("TG_BENCH_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(0),
        Ok("cpu") | Err(_) => Device::Cpu,
        Ok(other) => panic!("TG_BENCH_DEVICE: expected cpu or cuda, got `{other}`"),
    };
    let config = std::env::var("TG_BENCH_CONFIG").unwrap_or_else(|_| "configs/gpt2-124m.yaml".into());
    let steps: usize = std::env::var("STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    // The repository: TRAINGUARD_REPO where the binary was carried to another machine.
    let repo = std::env::var_os("TRAINGUARD_REPO").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."),
        std::path::PathBuf::from,
    );
    let cfg = trainguard::config::load(Some(&repo.join(&config)), &[]).expect("config");
    let model = Model::new(&cfg.model, 0, device).unwrap();
    let params = model.optimizer_params().unwrap();
    let numel: i64 = params.iter().map(|p| p.numel() as i64).sum();
    let grads: Vec<Tensor> = params.iter().map(|p| p.randn_like() * 1e-3).collect();
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    println!(
        "{config}: {} tensors, {:.1}M values, {device:?}, median of {steps} updates after 2 warm-up",
        params.len(),
        numel as f64 / 1e6
    );
    println!("| optimizer | ms per update (median) | min – max | × fused AdamW's time |\n|---|---|---|---|");
    let mut reference = None;
    // On CUDA 8-bit AdamW and Adafactor run twice: tensor ops, then our NVRTC kernels
    // (kernels.cuda_optimizers).
    let on_cuda = |name| device.is_cuda().then_some((name, false, true));
    let rows = [
        (OptimizerName::Adamw, true, false),
        (OptimizerName::Adamw, false, false),
        (OptimizerName::Adamw8bit, false, false),
    ]
    .into_iter()
    .chain(on_cuda(OptimizerName::Adamw8bit));
    let rows =
        rows.chain([(OptimizerName::Adafactor, false, false)]).chain(on_cuda(OptimizerName::Adafactor));
    let rows =
        rows.chain([(OptimizerName::SgdMomentum, true, false), (OptimizerName::SgdMomentum, false, false)]);
    for (name, fused, cuda_kernel) in rows {
        let mut opt = Optimizer::new(
            &OptimizerSpec { cuda_kernel, ..OptimizerSpec::with_defaults(name, fused) },
            &params,
            &model.params.decay,
            device,
        )
        .unwrap();
        let mut times = Vec::with_capacity(steps);
        for i in 0..steps + 2 {
            sync();
            let t0 = Instant::now();
            opt.step(&params, &grads, 1e-4).unwrap();
            sync();
            if i >= 2 {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let base = *reference.get_or_insert(median);
        let has_both = matches!(name, OptimizerName::Adamw | OptimizerName::SgdMomentum);
        let path = match (has_both, fused) {
            (true, true) => " (fused)",
            (true, false) => " (unfused)",
            _ if matches!(name, OptimizerName::Adamw8bit | OptimizerName::Adafactor) && device.is_cuda() => {
                if cuda_kernel {
                    " (CUDA kernel)"
                } else {
                    " (tensor ops)"
                }
            }
            _ => "",
        };
        let label = format!("{}{path}", opt.kind());
        println!(
            "| {label} | {median:.2} | {:.2} – {:.2} | {:.2}× |",
            times[0],
            times[times.len() - 1],
            median / base
        );
    }
}
