//! The memory reading after each step and what it may set off: a leak warning (allocated memory
//! rising step after step), and on allocator thrashing (retries rising) a warning or, with
//! `oom.on_thrash: shrink`, a smaller micro-batch ahead of an out-of-memory.
use crate::config::{Config, ThrashAction};
use crate::events::{Event, Reporter};
use crate::guard::GuardState;
use crate::memory::detect::{LeakDetector, ThrashDetector};
use crate::memory::telemetry::{MemoryMetrics, Telemetry};
use tch::Device;

pub(super) struct MemoryWatch {
    telemetry: Telemetry,
    leak: LeakDetector,
    thrash: ThrashDetector,
    on_thrash: ThrashAction,
}

impl MemoryWatch {
    pub(super) fn new(cfg: &Config, device: Device) -> Self {
        Self {
            telemetry: Telemetry::new(device),
            // The first steps allocate what stays (optimizer state, caches): not a leak.
            leak: LeakDetector::new(cfg.memory.leak_check_steps, 5),
            thrash: ThrashDetector::new(3),
            on_thrash: cfg.oom.on_thrash,
        }
    }

    /// Reads memory after step `step`, reports what the detectors see, and returns the figures
    /// for the step's metrics line.
    pub(super) fn after_step(
        &mut self,
        step: u64,
        guard: &mut GuardState,
        reporter: &mut Reporter,
    ) -> MemoryMetrics {
        let memory = self.telemetry.sample();
        if let Some(message) = Telemetry::leak_figure(&memory).and_then(|b| self.leak.observe(b)) {
            reporter.emit(Event::LeakSuspected { step, message });
        }
        let total_retries = self.telemetry.total_retries;
        if memory.alloc_retries.is_some() && self.thrash.observe(total_retries) {
            let shrink = self.on_thrash == ThrashAction::Shrink;
            let new_micro_batch = if shrink { guard.shrink(step) } else { None };
            let action = if shrink { "shrink" } else { "warn" }.to_string();
            reporter.emit(Event::ThrashDetected { step, total_retries, action, new_micro_batch });
        }
        memory
    }
}
