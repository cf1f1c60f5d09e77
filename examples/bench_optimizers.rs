//! Time of one optimizer update, each optimizer against fused AdamW in the same process, on the
//! parameters of a real model (default GPT-2 124M: 148 tensors, 124.4M values): what issue 15's
//! "8-bit AdamW and Adafactor within 5% of fused AdamW" is about, without the forward and
//! backward around it. Prints the median and the spread of `STEPS` updates after 2 warm-up ones.
//!
//!   cargo run --release --example bench_optimizers -- [--device cpu|cuda] [config.yaml]
//!   (scripts/bench_optimizers.sh wraps it; on a machine without Rust, carry
//!   target/release/examples/bench_optimizers)
use std::time::Instant;
use tch::{Device, Tensor};
use trainguard::config::{Config, OptimizerName};
use trainguard::model::Model;
use trainguard::optim::{Optimizer, OptimizerSpec};

fn main() -> anyhow::Result<()> {
    let mut device = Device::Cpu;
    let mut config = "configs/gpt2-124m.yaml".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => device = parse_device(&args.next().unwrap_or_default())?,
            "-h" | "--help" => {
                println!("usage: bench_optimizers [--device cpu|cuda] [config.yaml]   (env STEPS, default 10)");
                return Ok(());
            }
            path => config = path.to_string(),
        }
    }
    let steps: usize = std::env::var("STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let cfg: Config = trainguard::config::load(Some(std::path::Path::new(&config)), &[])?;
    let model = Model::new(&cfg.model, 0, device)?;
    let params = model.optimizer_params()?;
    let numel: i64 = params.iter().map(|p| p.numel() as i64).sum();
    let grads: Vec<Tensor> = params.iter().map(|p| p.randn_like() * 1e-3).collect();
    println!("{config}: {} tensors, {:.1}M values, {device:?}, median of {steps} updates after 2 warm-up", params.len(), numel as f64 / 1e6);
    println!("| optimizer | ms per update (median) | min – max | × fused AdamW's time |\n|---|---|---|---|");
    let mut reference = None;
    for (label, name, fused) in [
        ("adamw (fused)", OptimizerName::Adamw, true),
        ("adamw (unfused)", OptimizerName::Adamw, false),
        ("adamw8bit", OptimizerName::Adamw8bit, false),
        ("adafactor", OptimizerName::Adafactor, false),
        ("sgd_momentum", OptimizerName::SgdMomentum, false),
    ] {
        let spec = OptimizerSpec { name, fused, momentum: 0.9, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = Optimizer::new(&spec, &params, &model.params.decay, device)?;
        let mut times = Vec::with_capacity(steps);
        for i in 0..steps + 2 {
            sync(device);
            let t0 = Instant::now();
            opt.step(&params, &grads, 1e-4)?;
            sync(device);
            if i >= 2 {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let base = *reference.get_or_insert(median);
        println!("| {label} | {median:.2} | {:.2} – {:.2} | {:.2}× |", times[0], times[times.len() - 1], median / base);
    }
    Ok(())
}

fn parse_device(s: &str) -> anyhow::Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => anyhow::bail!("--device: expected cpu or cuda, got `{other}`"),
    }
}

/// Waits for the device's queued work, so the clock measures the update, not its launch.
fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}
