//! Adafactor (Shazeer & Stern, 2018) as `torch.optim.Adafactor` implements it (PyTorch ≥ 2.5):
//! no first moment; for a matrix the second moment is factored into a running mean of g² per row
//! and per column (R + C numbers instead of R·C); vectors keep a full second moment. The decay
//! rate follows 1 − β2,t = t^beta2_decay (−0.8), the update is clipped to RMS ≤ d, and the step
//! is relative to the parameter's scale: α = max(eps2, RMS(p)) · min(lr, 1/√t). So `lr` is used
//! as given (no relative-step schedule) until t > 1/lr², where PyTorch caps it. Weight decay is
//! decoupled (`p ·= 1 − lr·wd`) and applies only to parameters whose `decay` flag is set.
//!
//! Owns the row/column/full second moments. Two paths compute the update ([`Path`]):
//!
//! - The shim's fused kernel (`ffi::kernels::adafactor_update`). On the CPU: per tensor, four
//!   reads and one write, no scratch, reductions summed in a fixed order (bitwise the same at any
//!   thread count). On CUDA, with `kernels.cuda_optimizers`: our NVRTC-compiled kernels, five to
//!   seven launches per tensor, their sums in a small fp64 workspace allocated here once
//!   ([`Adafactor::workspace_elements`]: 3 MiB for GPT-2), nothing read back to the host.
//! - Otherwise on CUDA, tensor ops. Once built, the update makes no allocation the size of a tensor
//!   (CUDA's reduction kernels may take a few bytes of workspace for the norms, from the
//!   allocator's cache): the per-element update lives in a scratch buffer, and the scalars
//!   PyTorch reads back with `.item()` (the parameter's RMS, the update's RMS) stay on the device
//!   as 0-dim tensors, which also spares two host syncs per parameter. The scratch is bounded: a
//!   matrix larger than [`CHUNK_ELEMENTS`] is processed in bands of rows, twice (once for the
//!   update's norm, once to apply it), rather than holding an update as large as the embedding.
//!
//! The CPU tests check both against `torch.optim.Adafactor` and against each other.
use super::state::{bytes, check_lengths, restore};
use crate::ffi::kernels::{self, AdafactorStep, AdafactorWorkspace, SecondMoments, CUDA_BLOCK_VALUES};
use tch::{Device, Kind, TchError, Tensor};

/// Largest band (in elements) of a matrix's update held at once: 16 MiB of fp32 scratch.
pub const CHUNK_ELEMENTS: i64 = 1 << 22;

/// How the update is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The shim's fused kernel (CPU, or CUDA through NVRTC): no scratch (an fp64 workspace for
    /// the sums on CUDA).
    Fused,
    /// Tensor ops, matrices in bands of at most `chunk_elements` values.
    Bands { chunk_elements: i64 },
}

impl Path {
    /// The fused kernel on the CPU, and on CUDA when `cuda_kernel` (`kernels.cuda_optimizers`);
    /// bands of [`CHUNK_ELEMENTS`] otherwise.
    pub fn for_device(device: Device, cuda_kernel: bool) -> Path {
        if device == Device::Cpu || cuda_kernel {
            Path::Fused
        } else {
            Path::Bands { chunk_elements: CHUNK_ELEMENTS }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdafactorConfig {
    /// 1 − β2,t = t^beta2_decay; PyTorch's default −0.8.
    pub beta2_decay: f64,
    /// Floor of the second-moment estimate (squared before use); `None`: the parameter dtype's
    /// machine epsilon, as PyTorch does.
    pub eps1: Option<f64>,
    /// Floor of the parameter RMS that scales the step (PyTorch's default 1e-3).
    pub eps2: f64,
    /// Update clipping threshold d (RMS of the update at most d).
    pub d: f64,
    pub weight_decay: f64,
}

impl Default for AdafactorConfig {
    /// PyTorch's defaults, without weight decay.
    fn default() -> Self {
        Self { beta2_decay: -0.8, eps1: None, eps2: 1e-3, d: 1.0, weight_decay: 0.0 }
    }
}

/// Second-moment state of one parameter.
pub enum SecondMoment {
    /// A matrix [R, C]: running means of g² over each row ([R, 1]) and each column ([1, C]).
    Factored { row_var: Tensor, col_var: Tensor },
    /// A vector or scalar: the running mean of g², element by element.
    Full { variance: Tensor },
}

pub struct Adafactor {
    pub cfg: AdafactorConfig,
    pub state: Vec<SecondMoment>,
    /// Updates applied so far (the decay rate and the step-size cap use it).
    pub steps: u64,
    decay: Vec<bool>,
    path: Path,
    /// The update of one band, in the parameters' dtype (as PyTorch computes it).
    scratch: Tensor,
    /// Row and column means of g² of the current step, before they enter the running means.
    row_mean: Tensor,
    col_mean: Tensor,
    /// [1, 1]: mean of the row factors, which normalises their outer product.
    row_var_mean: Tensor,
    /// 0-dim, parameters' dtype: where norms land (a norm's output must have its input's dtype).
    norm: Tensor,
    /// 0-dim fp32: the step size α, then −α/denominator.
    alpha: Tensor,
    /// 0-dim fp32: the update's sum of squares, then the clipping denominator.
    denom: Tensor,
    /// The CUDA kernels' fp64 sums ([`Adafactor::workspace_elements`]); `None` on the CPU and the band path.
    workspace: Option<Tensor>,
}

impl Adafactor {
    /// Runs of rows a matrix's column sums of g² are split into on CUDA: enough CUDA blocks to
    /// fill a GPU (up to 128 runs), at most 2²⁰ partial sums, never more runs than rows.
    pub fn column_bands(rows: i64, cols: i64) -> i64 {
        rows.min(128).min(((1 << 20) / cols.max(1)).max(1)).max(1)
    }

    /// fp64 values of the workspace `path` needs on `device` for parameters of `shapes`: none
    /// but for the fused kernels on CUDA, which keep 4 scalars, a sum per unit (a matrix's row,
    /// or [`CUDA_BLOCK_VALUES`] values of anything else) and a matrix's column sums per band.
    /// The planner counts the same.
    pub fn workspace_elements(shapes: impl IntoIterator<Item = Vec<i64>>, path: Path, device: Device) -> i64 {
        if path != Path::Fused || !kernels::runs_cuda_kernels(device) {
            return 0;
        }
        shapes.into_iter().fold(4, |most, shape| {
            let need = match shape[..] {
                [rows, cols] => rows + Self::column_bands(rows, cols) * cols,
                _ => (shape.iter().product::<i64>() + CUDA_BLOCK_VALUES - 1) / CUDA_BLOCK_VALUES,
            };
            most.max(4 + need)
        })
    }

    pub fn new(
        cfg: AdafactorConfig,
        params: &[Tensor],
        decay: &[bool],
        device: Device,
    ) -> Result<Self, TchError> {
        Self::with_path(cfg, params, decay, device, Path::for_device(device, false))
    }

    /// Elements of the three buffers the tensor-op path works in, for parameters of `shapes`:
    /// the update of one band of rows (or of one whole vector), the row means and the column
    /// means, each in the parameters' dtype. The fused kernel needs none (1 each; on CUDA it
    /// has its [`workspace_elements`](Self::workspace_elements)). The planner counts the same.
    pub fn scratch_elements(shapes: impl IntoIterator<Item = Vec<i64>>, path: Path) -> [i64; 3] {
        let Path::Bands { chunk_elements } = path else { return [1, 1, 1] };
        shapes.into_iter().fold([1, 1, 1], |[update, rows_max, cols_max], shape| match shape[..] {
            [rows, cols] => [
                update.max(band_rows(rows, cols, chunk_elements) * cols),
                rows_max.max(rows),
                cols_max.max(cols),
            ],
            _ => [update.max(shape.iter().product()), rows_max, cols_max],
        })
    }

    /// [`new`](Self::new) with the path chosen (tests run both on the CPU, and small bands to
    /// exercise banding).
    pub fn with_path(
        cfg: AdafactorConfig,
        params: &[Tensor],
        decay: &[bool],
        device: Device,
        path: Path,
    ) -> Result<Self, TchError> {
        let kind = params.first().map_or(Kind::Float, Tensor::kind);
        if let Some(p) = params.iter().find(|p| p.kind() != kind) {
            return Err(TchError::Kind(format!(
                "adafactor needs parameters of one dtype, got {kind:?} and {:?}",
                p.kind()
            )));
        }
        let mut state = Vec::with_capacity(params.len());
        for p in params {
            match p.size()[..] {
                [rows, cols] => {
                    state.push(SecondMoment::Factored {
                        row_var: Tensor::f_zeros([rows, 1], (kind, device))?,
                        col_var: Tensor::f_zeros([1, cols], (kind, device))?,
                    });
                }
                [] | [_] => state.push(SecondMoment::Full { variance: Tensor::f_zeros_like(p)? }),
                ref shape => {
                    return Err(TchError::Shape(format!(
                        "adafactor factors matrices and keeps vectors whole; a parameter has shape {shape:?}"
                    )))
                }
            }
        }
        let workspace = match Self::workspace_elements(params.iter().map(Tensor::size), path, device) {
            0 => None,
            elements => {
                kernels::prepare_cuda(device).map_err(|e| {
                    TchError::Torch(format!(
                        "Adafactor's CUDA kernels (kernels.cuda_optimizers) cannot be used: {e}"
                    ))
                })?;
                Some(Tensor::f_zeros([elements], (Kind::Double, device))?)
            }
        };
        let [scratch_len, max_rows, max_cols] = Self::scratch_elements(params.iter().map(Tensor::size), path);
        let scalar = |k: Kind| Tensor::f_zeros([], (k, device));
        Ok(Self {
            cfg,
            state,
            steps: 0,
            decay: decay.to_vec(),
            path,
            scratch: Tensor::f_empty([scratch_len], (kind, device))?,
            row_mean: Tensor::f_empty([max_rows], (kind, device))?,
            col_mean: Tensor::f_empty([max_cols], (kind, device))?,
            row_var_mean: Tensor::f_empty([1, 1], (kind, device))?,
            norm: scalar(kind)?,
            alpha: scalar(Kind::Float)?,
            denom: scalar(Kind::Float)?,
            workspace,
        })
    }

    /// Applies one update with learning rate `lr` from `grads` (same order as `params`).
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        check_lengths(params, grads, self.state.len())?;
        self.steps = self.steps.saturating_add(1);
        let t = self.steps as f64;
        let one_minus_beta2 = t.powf(self.cfg.beta2_decay);
        let rho = lr.min(1.0 / t.powf(0.5));
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            if p.numel() == 0 {
                continue; // no RMS to scale by, nothing to update
            }
            let mut p = p.shallow_clone();
            let n = p.numel() as f64;
            let eps1 = self.cfg.eps1.unwrap_or_else(|| machine_epsilon(p.kind()));
            let decays = self.decay[i] && self.cfg.weight_decay != 0.0;
            let Path::Bands { chunk_elements } = self.path else {
                let moments = match &self.state[i] {
                    SecondMoment::Factored { row_var, col_var } => {
                        SecondMoments::Factored { row_var, col_var }
                    }
                    SecondMoment::Full { variance } => SecondMoments::Full { variance },
                };
                let shrink = if decays { 1.0 - lr * self.cfg.weight_decay } else { 1.0 };
                let AdafactorConfig { eps2, d, .. } = self.cfg;
                let workspace = self.workspace.as_ref().map(|buffer| {
                    let column_bands = match p.size()[..] {
                        [rows, cols] => Self::column_bands(rows, cols),
                        _ => 1,
                    };
                    AdafactorWorkspace { buffer, column_bands }
                });
                kernels::adafactor_update(
                    &p,
                    g,
                    moments,
                    AdafactorStep { one_minus_beta2, rho, eps1, eps2, d, shrink },
                    workspace.as_ref(),
                )?;
                continue;
            };
            // α = max(eps2, RMS(p)) · ρ, from the parameter before this step's decay.
            self.norm_into_alpha(&p)?;
            let _ = self.alpha.f_div_scalar_(n.sqrt())?;
            let _ = self.alpha.f_clamp_min_(self.cfg.eps2)?;
            let _ = self.alpha.f_mul_scalar_(rho)?;
            if decays {
                let _ = p.f_mul_scalar_(1.0 - lr * self.cfg.weight_decay)?;
            }
            let bands = match &mut self.state[i] {
                SecondMoment::Factored { row_var, col_var } => {
                    let (rows, cols) = (g.size()[0], g.size()[1]);
                    // Row and column means of g², as PyTorch writes them: ‖g‖² along an axis
                    // over its length (no temporary the size of g).
                    let rm = self.row_mean.f_narrow(0, 0, rows)?.f_view([rows, 1])?;
                    let mut rm = g.f_norm_out(&rm, 2, [-1], true)?;
                    let _ = rm.f_square_()?;
                    let _ = rm.f_div_scalar_(cols as f64)?;
                    let _ = row_var.f_lerp_(&rm, one_minus_beta2)?;
                    let cm = self.col_mean.f_narrow(0, 0, cols)?.f_view([1, cols])?;
                    let mut cm = g.f_norm_out(&cm, 2, [-2], true)?;
                    let _ = cm.f_square_()?;
                    let _ = cm.f_div_scalar_(rows as f64)?;
                    let _ = col_var.f_lerp_(&cm, one_minus_beta2)?;
                    let mut rvm =
                        row_var.f_mean_out(&self.row_var_mean, [-2i64].as_slice(), true, None::<Kind>)?;
                    let _ = rvm.f_clamp_min_(eps1)?;
                    let band = band_rows(rows, cols, chunk_elements);
                    (0..rows).step_by(band as usize).map(|r0| (r0, band.min(rows - r0))).collect::<Vec<_>>()
                }
                SecondMoment::Full { variance } => {
                    let u = self.scratch.f_narrow(0, 0, g.numel() as i64)?.f_view(g.size().as_slice())?;
                    let _ = g.f_mul_out(&u, g)?;
                    let _ = variance.f_lerp_(&u, one_minus_beta2)?;
                    Vec::new()
                }
            };
            // The update u = g / √max(v̂, eps1²), its RMS clipped to d: p −= α · u / max(1, RMS(u)/d).
            if bands.len() > 1 {
                // Pass 1: Σu² band by band; pass 2 below recomputes each band to apply it.
                let _ = self.denom.f_zero_()?;
                for &(r0, len) in &bands {
                    let u = self.update_band(i, g, r0, len, eps1)?;
                    self.norm_into(&u, false)?;
                }
                let _ = self.denom.f_sqrt_()?;
            } else {
                let u = match bands.first() {
                    Some(&(r0, len)) => self.update_band(i, g, r0, len, eps1)?,
                    None => self.update_full(i, g, eps1)?,
                };
                self.norm_into(&u, true)?;
            }
            let _ = self.denom.f_div_scalar_(n.sqrt() * self.cfg.d)?;
            let _ = self.denom.f_clamp_min_(1.0)?;
            let _ = self.alpha.f_div_(&self.denom)?;
            let _ = self.alpha.f_neg_()?;
            match bands.len() {
                0 => {
                    let u = self.scratch.f_narrow(0, 0, g.numel() as i64)?.f_view(g.size().as_slice())?;
                    let _ = p.f_addcmul_(&u, &self.alpha)?;
                }
                1 => {
                    let u = self.scratch.f_narrow(0, 0, p.numel() as i64)?.f_view(p.size().as_slice())?;
                    let _ = p.f_addcmul_(&u, &self.alpha)?;
                }
                _ => {
                    for &(r0, len) in &bands {
                        let u = self.update_band(i, g, r0, len, eps1)?;
                        let _ = p.f_narrow(0, r0, len)?.f_addcmul_(&u, &self.alpha)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The update of rows `r0..r0+len` of factored parameter `i`, in the scratch buffer:
    /// g / √max(row_var ⊗ col_var / mean(row_var), eps1²).
    fn update_band(&self, i: usize, g: &Tensor, r0: i64, len: i64, eps1: f64) -> Result<Tensor, TchError> {
        let SecondMoment::Factored { row_var, col_var } = &self.state[i] else {
            unreachable!("bands exist for factored parameters only")
        };
        let cols = g.size()[1];
        let u = self.scratch.f_narrow(0, 0, len * cols)?.f_view([len, cols])?;
        // An outer product: PyTorch's `row_var @ col_var` with an inner dimension of 1, which is
        // one multiplication per element, so the broadcast product is the same numbers.
        let mut u = row_var.f_narrow(0, r0, len)?.f_mul_out(&u, col_var)?;
        let _ = u.f_div_(&self.row_var_mean)?;
        let _ = u.f_clamp_min_(eps1 * eps1)?;
        let _ = u.f_rsqrt_()?;
        let _ = u.f_mul_(&g.f_narrow(0, r0, len)?)?;
        Ok(u)
    }

    /// The update of unfactored parameter `i`, in the scratch buffer (which holds g² on entry).
    fn update_full(&self, i: usize, g: &Tensor, eps1: f64) -> Result<Tensor, TchError> {
        let SecondMoment::Full { variance } = &self.state[i] else {
            unreachable!("only unfactored parameters have a full variance")
        };
        let mut u = self.scratch.f_narrow(0, 0, g.numel() as i64)?.f_view(g.size().as_slice())?;
        u.f_copy_(variance)?;
        let _ = u.f_clamp_min_(eps1 * eps1)?;
        let _ = u.f_rsqrt_()?;
        let _ = u.f_mul_(g)?;
        Ok(u)
    }

    /// `alpha = ‖p‖₂` (through `norm` when the parameters are not fp32).
    fn norm_into_alpha(&mut self, p: &Tensor) -> Result<(), TchError> {
        let _ = p.f_norm_scalar_out(&self.norm)?;
        self.alpha.f_copy_(&self.norm)?;
        Ok(())
    }

    /// `denom = ‖u‖₂` when `set`, else `denom += ‖u‖₂²` (one band's share of the sum of squares).
    fn norm_into(&mut self, u: &Tensor, set: bool) -> Result<(), TchError> {
        let _ = u.f_norm_scalar_out(&self.norm)?;
        if set {
            self.denom.f_copy_(&self.norm)?;
        } else {
            let _ = self.denom.f_addcmul_(&self.norm, &self.norm)?;
        }
        Ok(())
    }

    /// Second moments as `row_var.<param>` [R, 1] and `col_var.<param>` [1, C] for matrices,
    /// `variance.<param>` otherwise (PyTorch's state names and shapes).
    pub fn state_tensors(&self, names: &[String]) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * names.len());
        for (s, n) in self.state.iter().zip(names) {
            match s {
                SecondMoment::Factored { row_var, col_var } => {
                    out.push((format!("row_var.{n}"), row_var.shallow_clone()));
                    out.push((format!("col_var.{n}"), col_var.shallow_clone()));
                }
                SecondMoment::Full { variance } => {
                    out.push((format!("variance.{n}"), variance.shallow_clone()))
                }
            }
        }
        out
    }

    /// Restores moments saved by [`state_tensors`](Self::state_tensors) and the update count.
    pub fn load_state(
        &mut self,
        names: &[String],
        saved: &[(String, Tensor)],
        steps: u64,
    ) -> Result<(), String> {
        let _no_grad = tch::no_grad_guard();
        for (s, n) in self.state.iter_mut().zip(names) {
            match s {
                SecondMoment::Factored { row_var, col_var } => {
                    restore(row_var, saved, &format!("row_var.{n}"))?;
                    restore(col_var, saved, &format!("col_var.{n}"))?;
                }
                SecondMoment::Full { variance } => restore(variance, saved, &format!("variance.{n}"))?,
            }
        }
        self.steps = steps;
        Ok(())
    }

    pub fn state_bytes(&self) -> u64 {
        self.state
            .iter()
            .map(|s| match s {
                SecondMoment::Factored { row_var, col_var } => bytes(row_var) + bytes(col_var),
                SecondMoment::Full { variance } => bytes(variance),
            })
            .sum()
    }

    /// Device bytes of the update's scratch, the row/column buffers and the CUDA kernels' workspace
    /// (not checkpointed).
    pub fn scratch_bytes(&self) -> u64 {
        bytes(&self.scratch)
            + bytes(&self.row_mean)
            + bytes(&self.col_mean)
            + self.workspace.as_ref().map_or(0, bytes)
    }
}

/// Rows per band of an [rows, cols] matrix when bands hold at most `chunk_elements` values.
fn band_rows(rows: i64, cols: i64, chunk_elements: i64) -> i64 {
    (chunk_elements / cols.max(1)).clamp(1, rows.max(1))
}

/// `torch.finfo(dtype).eps`, PyTorch's default eps1.
fn machine_epsilon(kind: Kind) -> f64 {
    match kind {
        Kind::Double => f64::EPSILON,
        Kind::Half => 2f64.powi(-10),
        Kind::BFloat16 => 2f64.powi(-7),
        _ => f32::EPSILON as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: [[f32; 4]; 3] = [[0.5, -0.3, 0.8, 0.1], [-0.6, 0.2, 0.4, -0.9], [0.7, -0.1, -0.5, 0.3]];
    const B: [f32; 4] = [0.05, -0.02, 0.1, 0.0];
    const GW: [[[f32; 4]; 3]; 4] = [
        [[0.1, -0.2, 0.3, 0.05], [0.0, 0.4, -0.1, 0.2], [-0.3, 0.1, 0.2, -0.05]],
        [[0.2, 0.1, -0.1, 0.0], [-0.2, 0.3, 0.1, 0.1], [0.05, -0.4, 0.3, 0.2]],
        [[-0.1, 0.0, 0.2, -0.3], [0.1, -0.1, 0.0, 0.4], [0.2, 0.2, -0.2, 0.1]],
        [[0.3, -0.3, 0.1, 0.1], [0.0, 0.0, 0.5, -0.2], [-0.1, 0.3, 0.0, 0.0]],
    ];
    const GB: [[f32; 4]; 4] =
        [[0.01, -0.02, 0.5, 0.0], [0.02, 0.01, -0.3, 0.1], [-0.05, 0.0, 0.2, 0.1], [0.0, 0.03, -0.1, -0.2]];

    /// Reference numbers from PyTorch 2.11 (`torch.optim.Adafactor`, for-loop implementation):
    /// ```python
    /// w = torch.tensor(W, requires_grad=True); b = torch.tensor(B, requires_grad=True)
    /// opt = torch.optim.Adafactor([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
    ///                             lr=0.05, foreach=False)   # beta2_decay=-0.8, eps=(None, 1e-3), d=1.0
    /// for gw, gb in zip(GW, GB):
    ///     w.grad = torch.tensor(gw); b.grad = torch.tensor(gb); opt.step()
    /// print(w.tolist(), b.tolist(), opt.state[w]["row_var"].flatten().tolist(), opt.state[w]["col_var"].flatten().tolist())
    /// ```
    #[allow(clippy::excessive_precision)] // PyTorch's printout, verbatim
    const REFERENCE_W: [[f32; 4]; 3] = [
        [0.406_673_58, -0.251_179_904, 0.718_644_261, 0.115_468_763],
        [-0.574_286_759, 0.145_820_2, 0.342_072_904, -0.961_388_528],
        [0.710_429_788, -0.130_105_287, -0.522_679_15, 0.259_333_014],
    ];
    #[allow(clippy::excessive_precision)]
    const REFERENCE_B: [f32; 4] = [0.047_913_461_9, -0.022_833_088_4, 0.098_427_504_3, -0.002_898_366_19];
    #[allow(clippy::excessive_precision)]
    const REFERENCE_ROW_VAR: [f32; 3] = [0.035_551_130_77, 0.053_634_606_30, 0.039_690_371_60];
    #[allow(clippy::excessive_precision)]
    const REFERENCE_COL_VAR: [f32; 4] =
        [0.028_310_272_84, 0.055_611_532_18, 0.052_045_822_14, 0.035_867_180_68];

    fn run(path: Path) -> (Adafactor, Tensor, Tensor) {
        let w = Tensor::from_slice(&W.concat()).view([3, 4]);
        let b = Tensor::from_slice(&B);
        let params = [w.shallow_clone(), b.shallow_clone()];
        let cfg = AdafactorConfig { weight_decay: 0.1, ..AdafactorConfig::default() };
        let mut opt = Adafactor::with_path(cfg, &params, &[true, false], Device::Cpu, path).unwrap();
        for (gw, gb) in GW.iter().zip(&GB) {
            opt.step(&params, &[Tensor::from_slice(&gw.concat()).view([3, 4]), Tensor::from_slice(gb)], 0.05)
                .unwrap();
        }
        (opt, w, b)
    }

    fn assert_close(got: &Tensor, want: &[f32], tol: f32, what: &str) {
        let got: Vec<f32> = Vec::try_from(&got.flatten(0, -1)).unwrap();
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() < tol, "{what}: got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn matches_torch_optim_adafactor_fused_whole_and_in_bands_of_rows() {
        // The CPU kernel; 12 elements in one band; bands of one row, and of two rows then one:
        // the two-pass path.
        let bands = [CHUNK_ELEMENTS, 4, 8].map(|chunk_elements| Path::Bands { chunk_elements });
        for path in [Path::Fused].into_iter().chain(bands) {
            let (opt, w, b) = run(path);
            assert_close(&w, &REFERENCE_W.concat(), 1e-6, &format!("matrix, {path:?}"));
            assert_close(&b, &REFERENCE_B, 1e-6, &format!("vector, {path:?}"));
            let SecondMoment::Factored { row_var, col_var } = &opt.state[0] else {
                panic!("the matrix is factored")
            };
            assert_eq!((row_var.size(), col_var.size()), (vec![3, 1], vec![1, 4]));
            assert_close(row_var, &REFERENCE_ROW_VAR, 1e-7, "row_var");
            assert_close(col_var, &REFERENCE_COL_VAR, 1e-7, "col_var");
        }
    }

    /// Both paths from the same state, one step at a time, on shapes that take several pieces
    /// and column tiles (a 300×70 matrix, a 5000-vector, a scalar), fp32 and bf16: the kernel
    /// sums in double where the tensor ops sum in the dtype, so they agree to rounding.
    #[test]
    fn the_fused_cpu_kernel_computes_what_the_tensor_ops_do() {
        let cfg = AdafactorConfig { weight_decay: 0.1, ..AdafactorConfig::default() };
        let names = ["w", "v", "s"].map(String::from);
        let wave = |n: usize, k: f64| {
            Tensor::from_slice(&(0..n).map(|i| ((i as f64 * k).sin() * 0.5) as f32).collect::<Vec<_>>())
        };
        for kind in [Kind::Float, Kind::BFloat16] {
            let make = || {
                [
                    wave(21_000, 0.37).view([300, 70]).to_kind(kind),
                    wave(5000, 1.3).to_kind(kind),
                    Tensor::from(0.3f32).to_kind(kind),
                ]
            };
            let (fused_p, ops_p) = (make(), make());
            let mut fused =
                Adafactor::with_path(cfg, &fused_p, &[true, false, true], Device::Cpu, Path::Fused).unwrap();
            let mut ops = Adafactor::with_path(
                cfg,
                &ops_p,
                &[true, false, true],
                Device::Cpu,
                Path::Bands { chunk_elements: 7000 },
            )
            .unwrap();
            for step in 0..5 {
                let grads = [
                    wave(21_000, 0.11 + step as f64).view([300, 70]).to_kind(kind),
                    wave(5000, 0.7 + step as f64).to_kind(kind) * 0.01,
                    Tensor::from(0.2f32).to_kind(kind),
                ];
                for (f, o) in fused_p.iter().zip(&ops_p) {
                    o.shallow_clone().copy_(f);
                }
                ops.load_state(&names, &fused.state_tensors(&names), fused.steps).unwrap();
                let before: Vec<Tensor> = fused_p.iter().map(Tensor::copy).collect();
                fused.step(&fused_p, &grads, 0.01).unwrap();
                ops.step(&ops_p, &grads, 0.01).unwrap();
                // fp32: a few ulps of the parameter, or of the step (0.01·RMS-scaled); bf16: the
                // tensor ops round after the decay and again after the step, the kernel once.
                let ulps = if kind == Kind::Float { 8.0 * f32::EPSILON as f64 } else { 1.0 / 128.0 };
                for (j, ((f, o), b)) in fused_p.iter().zip(&ops_p).zip(&before).enumerate() {
                    let step_size = (o - b).abs();
                    let worst = ((f - o).abs() - (o.abs() + b.abs() + step_size * 4.0) * ulps)
                        .max()
                        .double_value(&[]);
                    assert!(
                        worst <= 0.0,
                        "{kind:?} step {step}, tensor {j}: parameters differ by {worst} beyond the bound"
                    );
                }
                for ((key, f), (_, o)) in fused.state_tensors(&names).iter().zip(&ops.state_tensors(&names)) {
                    let rel = ((f - o).abs() / o.abs().clamp_min(1e-30)).max().double_value(&[]);
                    assert!(rel <= 2.0 * ulps, "{kind:?} step {step}: `{key}` differs by {rel} relative");
                }
            }
            assert!(!fused_p[0].equal(&make()[0]), "the parameters moved");
        }
    }

    /// The CUDA kernels' workspace, which the optimizer allocates once and the planner counts:
    /// a sum per row (or per 2048 values) and a matrix's column sums in at most 128 bands and
    /// 2²⁰ values, whichever tensor needs most.
    #[test]
    fn the_cuda_workspace_holds_a_sum_per_unit_and_banded_column_sums() {
        assert_eq!(Adafactor::column_bands(50_304, 768), 128, "a tall matrix: 128 bands");
        assert_eq!(Adafactor::column_bands(5, 768), 5, "never more bands than rows");
        assert_eq!(Adafactor::column_bands(4096, 50_304), 20, "2^20 / 50304 bands of a wide matrix");
        assert_eq!(Adafactor::column_bands(10, 1 << 22), 1, "at least one band");
        let cuda = |shapes: &[Vec<i64>]| {
            Adafactor::workspace_elements(shapes.to_vec(), Path::Fused, Device::Cuda(0))
        };
        assert_eq!(cuda(&[vec![5000]]), 4 + 3, "a vector: one sum per 2048 values");
        assert_eq!(cuda(&[vec![]]), 4 + 1, "a scalar is one unit");
        assert_eq!(cuda(&[vec![300, 70], vec![5000]]), 4 + 300 + 128 * 70);
        let gpt2 = [
            vec![50_304, 768],
            vec![1024, 768],
            vec![2304, 768],
            vec![3072, 768],
            vec![768, 3072],
            vec![768],
        ];
        let elements = cuda(&gpt2);
        assert_eq!(
            elements,
            4 + 768 + 128 * 3072,
            "the MLP's down-projection: 128 bands of 3072 column sums"
        );
        assert_eq!((elements * 8) >> 20, 3, "3 MiB for GPT-2");
        assert_eq!(
            Adafactor::workspace_elements(gpt2.to_vec(), Path::Fused, Device::Cpu),
            0,
            "the CPU kernel sums in registers"
        );
        let bands = Path::Bands { chunk_elements: CHUNK_ELEMENTS };
        assert_eq!(
            Adafactor::workspace_elements(gpt2.to_vec(), bands, Device::Cuda(0)),
            0,
            "tensor ops need no workspace"
        );
        assert_eq!(Path::for_device(Device::Cpu, false), Path::Fused);
        assert_eq!(Path::for_device(Device::Cuda(0), true), Path::Fused, "kernels.cuda_optimizers");
        assert_eq!(Path::for_device(Device::Cuda(0), false), Path::Bands { chunk_elements: CHUNK_ELEMENTS });
    }

    #[test]
    fn state_is_rows_plus_columns_for_matrices() {
        let (opt, _, _) = run(Path::Fused);
        assert_eq!(opt.state_bytes(), (3 + 4 + 4) * 4);
        let names: Vec<String> = ["w", "b"].map(String::from).to_vec();
        let keys: Vec<String> = opt.state_tensors(&names).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["row_var.w", "col_var.w", "variance.b"]);
    }

    #[test]
    fn tensors_of_three_dimensions_are_refused_not_mishandled() {
        let p = [Tensor::zeros([2, 3, 4], (Kind::Float, Device::Cpu))];
        assert!(matches!(
            Adafactor::new(AdafactorConfig::default(), &p, &[true], Device::Cpu),
            Err(TchError::Shape(_))
        ));
    }
}
