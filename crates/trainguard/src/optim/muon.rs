//! Muon: for the 2-D weight matrices inside the transformer blocks, SGD momentum whose update is
//! orthogonalised by a quintic Newton–Schulz iteration (the update's singular values pushed
//! towards 1); every other parameter (embeddings, the LM head, norms, biases) with AdamW, as the
//! published algorithm does (Keller Jordan's description and modded-nanogpt; written here from
//! the description). Per matrix `G` (the gradient) at learning rate `lr`:
//!
//! ```text
//! M ← β·M + (1−β)·G                       momentum (`optimizer.muon_momentum`, β = 0.95)
//! U ← (1−β)·G + β·M   (nesterov; else M)
//! X ← U / (‖U‖_F + 1e-7), transposed when it has more rows than columns
//! 5 × (`optimizer.muon_ns_steps`):  A ← X·Xᵀ;  X ← a·X + (b·A + c·A·A)·X,
//!                                    (a, b, c) = (3.4445, −4.7750, 2.0315)
//! W ← W·(1 − lr_m·λ) − lr_m · √max(1, rows/cols) · X
//! ```
//!
//! `lr_m` is `optimizer.muon_lr` scaled by the schedule as `train.lr` is; λ is
//! `train.weight_decay` (decoupled, on the matrices only, as AdamW's). The iteration runs in the
//! parameters' dtype (fp32 master weights; the published code runs it in bf16 on the GPU for
//! speed). Every matrix's update is computed before any is applied (one buffer per matrix, the
//! size of the matrix): an out-of-memory inside the iteration changes nothing and the guard
//! replays the step, as it does for the other optimizers.
use super::adamw::{AdamW, AdamWConfig};
use tch::{Device, TchError, Tensor};

/// The Newton–Schulz iteration's quintic coefficients (the published ones).
const NS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MuonConfig {
    /// `optimizer.muon_lr / train.lr`: the schedule's rate times this is the matrices' rate.
    pub lr_scale: f64,
    pub momentum: f64,
    pub nesterov: bool,
    pub ns_steps: usize,
    /// Decoupled, on the orthogonalised matrices (the others decay as `adamw` says).
    pub weight_decay: f64,
    /// The optimizer of every other parameter.
    pub adamw: AdamWConfig,
}

pub struct Muon {
    pub cfg: MuonConfig,
    /// Indices (into the parameter list) of the orthogonalised matrices, and their momentum.
    matrices: Vec<usize>,
    pub momentum: Vec<Tensor>,
    /// Each matrix's next update, all computed before any is applied.
    updates: Vec<Tensor>,
    /// Indices of the other parameters, which `adamw` updates.
    others: Vec<usize>,
    pub adamw: AdamW,
    /// Updates applied so far.
    pub steps: u64,
}

impl Muon {
    /// `orthogonalised[i]`: parameter `i` is a hidden weight matrix (2-D, inside a block).
    pub fn new(
        cfg: MuonConfig,
        params: &[Tensor],
        decay: &[bool],
        orthogonalised: &[bool],
        device: Device,
    ) -> Result<Self, TchError> {
        let (matrices, others): (Vec<usize>, Vec<usize>) =
            (0..params.len()).partition(|&i| orthogonalised[i] && params[i].dim() == 2);
        let pick = |idx: &[usize]| idx.iter().map(|&i| params[i].shallow_clone()).collect::<Vec<_>>();
        let other_decay: Vec<bool> = others.iter().map(|&i| decay[i]).collect();
        Ok(Self {
            cfg,
            momentum: matrices.iter().map(|&i| params[i].f_zeros_like()).collect::<Result<_, _>>()?,
            updates: matrices.iter().map(|&i| params[i].f_zeros_like()).collect::<Result<_, _>>()?,
            adamw: AdamW::new(cfg.adamw, &pick(&others), &other_decay, device)?,
            matrices,
            others,
            steps: 0,
        })
    }

    /// Applies one update with learning rate `lr` (AdamW's; the matrices' is `lr · lr_scale`).
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        let MuonConfig { lr_scale, momentum: beta, nesterov, ns_steps, weight_decay, .. } = self.cfg;
        let lr_m = lr * lr_scale;
        // Computed for every matrix first; nothing the step keeps changes until all succeeded.
        for (k, &i) in self.matrices.iter().enumerate() {
            let g = &grads[i];
            let m = self.momentum[k].f_lerp(g, 1.0 - beta)?;
            let u = if nesterov { g.f_lerp(&m, beta)? } else { m };
            let x = orthogonalise(&u, ns_steps)?;
            let (rows, cols) = (g.size()[0] as f64, g.size()[1] as f64);
            self.updates[k].f_copy_(&x)?;
            let _ = self.updates[k].f_mul_scalar_(-lr_m * (rows / cols).max(1.0).sqrt())?;
        }
        self.steps += 1;
        for (k, &i) in self.matrices.iter().enumerate() {
            let _ = self.momentum[k].f_lerp_(&grads[i], 1.0 - beta)?;
            let mut p = params[i].shallow_clone();
            if weight_decay > 0.0 && lr_m > 0.0 {
                let _ = p.f_mul_scalar_(1.0 - lr_m * weight_decay)?;
            }
            let _ = p.f_add_(&self.updates[k])?;
        }
        let pick = |t: &[Tensor]| self.others.iter().map(|&i| t[i].shallow_clone()).collect::<Vec<_>>();
        let (other_params, other_grads) = (pick(params), pick(grads));
        self.adamw.step(&other_params, &other_grads, lr)
    }

    /// Back to `steps` updates, AdamW's count too (a failed update is not counted).
    pub fn count_back_to(&mut self, steps: u64) {
        self.steps = steps;
        self.adamw.count_back_to(steps);
    }

    /// `momentum_buffer.<matrix>` and AdamW's `exp_avg.<other>`, `exp_avg_sq.<other>`.
    pub fn state_tensors(&self, names: &[String]) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = self
            .matrices
            .iter()
            .zip(&self.momentum)
            .map(|(&i, m)| (format!("momentum_buffer.{}", names[i]), m.shallow_clone()))
            .collect();
        out.extend(self.adamw.state_tensors(&self.other_names(names)));
        out
    }

    /// Restores what [`state_tensors`](Self::state_tensors) saved, and the update count.
    pub fn load_state(
        &mut self,
        names: &[String],
        saved: &[(String, Tensor)],
        steps: u64,
    ) -> Result<(), String> {
        for (&i, m) in self.matrices.iter().zip(&mut self.momentum) {
            super::state::restore(m, saved, &format!("momentum_buffer.{}", names[i]))?;
        }
        self.adamw.load_state(&self.other_names(names), saved, steps)?;
        self.steps = steps;
        Ok(())
    }

    fn other_names(&self, names: &[String]) -> Vec<String> {
        self.others.iter().map(|&i| names[i].clone()).collect()
    }

    /// Bytes of the saved state: the matrices' momentum and AdamW's moments.
    pub fn state_bytes(&self) -> u64 {
        self.momentum
            .iter()
            .chain(&self.adamw.exp_avg)
            .chain(&self.adamw.exp_avg_sq)
            .map(super::state::bytes)
            .sum()
    }

    /// Bytes of the update buffers (one per matrix), besides the state.
    pub fn scratch_bytes(&self) -> u64 {
        self.updates.iter().map(super::state::bytes).sum()
    }
}

/// The quintic Newton–Schulz iteration on `g` (2-D): an approximately orthogonal matrix with
/// `g`'s singular vectors.
pub fn orthogonalise(g: &Tensor, steps: usize) -> Result<Tensor, TchError> {
    let (a, b, c) = NS;
    let tall = g.size()[0] > g.size()[1];
    let mut x = if tall { g.f_transpose(0, 1)? } else { g.shallow_clone() };
    let norm = x.f_norm()?.f_add_scalar(1e-7)?;
    x = x.f_div(&norm)?;
    for _ in 0..steps {
        let gram = x.f_matmul(&x.f_transpose(0, 1)?)?;
        let poly = gram.f_mul_scalar(b)?.f_add(&gram.f_matmul(&gram)?.f_mul_scalar(c)?)?;
        x = x.f_mul_scalar(a)?.f_add(&poly.f_matmul(&x)?)?;
    }
    if tall {
        x = x.f_transpose(0, 1)?;
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// The iteration leaves singular values near 1 (the published coefficients aim at [0.7, 1.2]
    /// rather than exactly 1), for wide and tall matrices alike.
    #[test]
    fn the_iteration_makes_singular_values_near_one() {
        tch::manual_seed(3);
        for shape in [[16i64, 48], [48, 16], [32, 32]] {
            let g = Tensor::randn(shape, (Kind::Float, Device::Cpu));
            let x = orthogonalise(&g, 5).unwrap();
            assert_eq!(x.size(), shape.to_vec());
            // Singular values: square roots of the eigenvalues of the smaller Gram matrix.
            let gram = if shape[0] <= shape[1] { x.matmul(&x.tr()) } else { x.tr().matmul(&x) };
            let s = gram.linalg_eigvalsh("L").sqrt();
            let (lo, hi) = (s.min().double_value(&[]), s.max().double_value(&[]));
            assert!(lo > 0.5 && hi < 1.3, "{shape:?}: singular values in [{lo}, {hi}]");
        }
    }
}
