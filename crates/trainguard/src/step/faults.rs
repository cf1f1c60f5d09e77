//! Failures injected on purpose (`faults.*` in the config), at the points of a step where real
//! ones happen, so recovery paths are tested on the real binary. One hook object instead of
//! checks scattered through the loop; with the defaults every method is a no-op.
use super::micro::StepData;
use crate::config::FaultsConfig;
use crate::model::Model;
use tch::{TchError, Tensor};

/// What the run must do before a step, as if something outside had happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepFault {
    /// As if SIGTERM arrived (`faults.interrupt_at_step`).
    Interrupt,
    /// This rank fails with exit 1 (`faults.crash_at_step`, first torchrun attempt only).
    Crash,
}

#[derive(Default)]
pub struct Faults {
    cfg: FaultsConfig,
    rank: usize,
    restart_count: u64,
    /// `faults.leak_graphs`: what a leaking training script keeps alive, and the step of the
    /// last graph kept (a replayed step keeps none more).
    leaked: Vec<Tensor>,
    leaked_at: Option<u64>,
}

impl Faults {
    pub fn new(cfg: &FaultsConfig, rank: usize, restart_count: u64) -> Self {
        Self { cfg: cfg.clone(), rank, restart_count, leaked: Vec::new(), leaked_at: None }
    }

    /// `faults.fault_rank` names this rank, or no rank (then every rank).
    fn on_this_rank(&self) -> bool {
        self.cfg.fault_rank.is_none_or(|r| r == self.rank)
    }

    /// Checked before the step of loop index `step` starts, that is once `step` steps are done:
    /// `faults.interrupt_at_step: 20` stops with 20 steps done, as a signal would (checkpoint at
    /// step 20).
    pub fn before_step(&self, step: u64) -> Option<StepFault> {
        if self.cfg.crash_at_step == Some(step) && self.cfg.crash_rank == self.rank && self.restart_count == 0
        {
            return Some(StepFault::Crash);
        }
        (self.cfg.interrupt_at_step == Some(step)).then_some(StepFault::Interrupt)
    }

    /// After the gradients were averaged and unscaled: a NaN loss, or (fp16) an overflow; or an
    /// op with no deterministic implementation, or one that libtorch refuses. `index`: the
    /// loop's, from 0; the config names steps as a run reports them, from 1.
    pub(super) fn corrupt(
        &self,
        index: u64,
        loss: &mut f64,
        grads: &mut [Tensor],
        loss_scaled: bool,
    ) -> Result<(), TchError> {
        let step = index + 1;
        let this_rank = self.on_this_rank();
        if self.cfg.nonfinite_loss_at_steps.contains(&step) && this_rank {
            *loss = f64::NAN;
        }
        if self.cfg.nondeterministic_op_at_step == Some(step) && this_rank {
            let _ = Tensor::zeros([4], (tch::Kind::Float, tch::Device::Cpu)).f_put_(
                &Tensor::from_slice(&[1i64, 2]),
                &Tensor::from_slice(&[1f32, 2.0]),
                false,
            )?;
        }
        if self.cfg.failing_scalar_op_at_step == Some(step) && this_rank {
            let mut a = Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu));
            let _ = a.f_lerp_(&Tensor::ones([4], (tch::Kind::Float, tch::Device::Cpu)), 0.5)?;
        }
        if loss_scaled && self.cfg.fp16_overflow_at_steps.contains(&step) && this_rank {
            if let Some(g) = grads.first_mut() {
                let _ = g.f_fill_(f64::INFINITY)?;
            }
        }
        Ok(())
    }

    /// `faults.lr_spike`: the learning rate's multiplier for the step that draws data step
    /// `data_step` (the sampler's index, from 0; the config counts from 1). Every rank alike:
    /// the update is the group's.
    pub fn lr_multiplier(&self, data_step: u64) -> f64 {
        match self.cfg.lr_spike {
            Some(f) if f.data_step == data_step + 1 => f.factor,
            _ => 1.0,
        }
    }

    /// Keeps a forward graph alive across steps if asked to leak. Runs inside the guarded step
    /// before the update, so an out-of-memory here replays a step that changed nothing yet.
    pub(super) fn leak_graph(
        &mut self,
        model: &Model,
        data: &StepData,
        step: u64,
        micro: usize,
    ) -> Result<(), TchError> {
        if self.cfg.leak_graphs && self.on_this_rank() && self.leaked_at != Some(step) {
            let (x, _) = data.sampler.train_batch(
                data.corpus,
                step,
                data.rank_start..data.rank_start + micro,
                data.device,
            )?;
            self.leaked.push(model.forward(&x, true, None)?);
            self.leaked_at = Some(step);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `faults.fault_rank` names the rank whose loss turns non-finite; the others keep theirs.
    #[test]
    fn a_nonfinite_loss_is_injected_on_the_named_rank_only() {
        let cfg =
            FaultsConfig { nonfinite_loss_at_steps: vec![3], fault_rank: Some(1), ..FaultsConfig::default() };
        let loss_on = |rank: usize| {
            let mut loss = 2.5;
            Faults::new(&cfg, rank, 0).corrupt(2, &mut loss, &mut [], false).unwrap();
            loss
        };
        assert_eq!(loss_on(0), 2.5);
        assert!(loss_on(1).is_nan());
        let every_rank = FaultsConfig { fault_rank: None, ..cfg.clone() };
        let mut loss = 2.5;
        Faults::new(&every_rank, 0, 0).corrupt(2, &mut loss, &mut [], false).unwrap();
        assert!(loss.is_nan(), "without fault_rank every rank");
    }

    /// The spike goes with the data step it names (counted from 1), not with a step number: a
    /// run that skipped that data never takes it.
    #[test]
    fn the_learning_rate_spike_follows_its_data_step() {
        let cfg = FaultsConfig {
            lr_spike: Some(crate::config::LrSpikeFault { data_step: 31, factor: 300.0 }),
            ..FaultsConfig::default()
        };
        let f = Faults::new(&cfg, 0, 0);
        assert_eq!((f.lr_multiplier(29), f.lr_multiplier(30), f.lr_multiplier(31)), (1.0, 300.0, 1.0));
        assert_eq!(Faults::default().lr_multiplier(30), 1.0);
    }
}
