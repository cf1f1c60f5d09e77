//! What a notification says, pure: the `notify.on` name of an event, and the JSON body POSTed.
//!
//! The body has the fields the services read, each holding the same line: `text` (Slack's
//! incoming webhooks; Mattermost and Rocket.Chat read it too), `content` (Discord's execute
//! webhook, at most 2,000 characters), and `title` with `text` for ntfy's message templates
//! (a topic URL ending `?tpl=1&t={{.title}}&m={{.text}}`, ntfy 2.10 and later). Services ignore
//! the other fields, which hold the same news for a receiver of one's own: `event`, `run`,
//! `host`, `step`, `exit_code` and `details` (the event's `events.jsonl` line).
use crate::events::{Event, StopReason};
use serde_json::{json, Value};

/// Discord refuses a `content` over 2,000 characters; the line is cut below that.
pub const MAX_TEXT_CHARS: usize = 1900;

/// The `notify.on` name of `event`, when it has one: `finished`, `stopped` (a signal or the time
/// limit: the stops that end in a failure are the `crashed` notice's), `escalated`, and any other
/// event by its `events.jsonl` name, so events added later notify without more code. Steps
/// never do (nor are they serialised here: this runs on every step).
pub fn name_of(event: &Event) -> Option<String> {
    match event {
        Event::Step(_) => None,
        Event::RunFinished(_) => Some("finished".into()),
        Event::OomEscalated { .. } => Some("escalated".into()),
        Event::Stopped { reason: StopReason::Signal | StopReason::TimeLimit, .. } => Some("stopped".into()),
        Event::Stopped { .. } => None,
        other => serde_json::to_value(other).ok()?["event"].as_str().map(str::to_owned),
    }
}

/// One notification, before it becomes a body.
#[derive(Debug, Clone, PartialEq)]
pub struct Notice {
    /// Its `notify.on` name.
    pub name: String,
    /// What happened, in a few words (the title's end and the line's start).
    pub headline: String,
    pub step: Option<u64>,
    pub exit_code: Option<i32>,
    /// The event's JSON line, or the error's message for `crashed`.
    pub details: Value,
}

impl Notice {
    /// The notice for an event named `name` ([`name_of`]).
    pub fn of_event(name: String, event: &Event) -> Self {
        let details = serde_json::to_value(event).unwrap_or(Value::Null);
        // The steps done: `run_finished` counts them as `steps`.
        let step = details["step"].as_u64().or_else(|| details["steps"].as_u64());
        let headline = match event {
            Event::RunFinished(s) => format!(
                "finished {} steps, loss {:.4}{} in {}",
                s.steps,
                s.final_loss,
                s.final_val_loss.map(|v| format!(", validation {v:.4}")).unwrap_or_default(),
                duration(s.elapsed_s)
            ),
            Event::Stopped { step, reason, checkpoint } => format!(
                "stopped after step {step} ({reason}); {}",
                match checkpoint {
                    Some(_) => "checkpointed, --resume auto continues",
                    None => "no checkpoint",
                }
            ),
            Event::OomEscalated { step, switched_on, .. } => {
                format!("out of memory at the smallest micro-batch at step {step}: switched on {switched_on}")
            }
            _ => match step {
                Some(s) => format!("{} at step {s}", name.replace('_', " ")),
                None => name.replace('_', " "),
            },
        };
        Self { name, headline, step, exit_code: None, details }
    }

    /// The notice of a process ending with `code` (`kind`: the exit code's name), `message` its
    /// error.
    pub fn crashed(code: i32, kind: &str, message: &str) -> Self {
        let first = message.lines().next().unwrap_or_default();
        Self {
            name: "crashed".into(),
            headline: format!("crashed, exit {code} ({kind}): {first}"),
            step: None,
            exit_code: Some(code),
            details: json!({ "message": message }),
        }
    }

    /// The JSON body for the run `run` on `host`.
    pub fn body(&self, run: &str, host: &str) -> Value {
        let title = format!("trainguard {run}: {}", self.name.replace('_', " "));
        let text = cut(&format!("{run} on {host}: {}", self.headline), MAX_TEXT_CHARS);
        json!({
            "text": text,
            "content": text,
            "title": title,
            "event": self.name,
            "run": run,
            "host": host,
            "step": self.step,
            "exit_code": self.exit_code,
            "details": self.details,
        })
    }
}

/// `s` cut to at most `max` characters, ending `…` when cut.
fn cut(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max - 1).collect();
    out.push('…');
    out
}

fn duration(s: f64) -> String {
    match s {
        s if s < 90.0 => format!("{s:.0} s"),
        s if s < 5400.0 => format!("{:.0} min", s / 60.0),
        s => format!("{:.1} h", s / 3600.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::RunSummary;

    fn summary() -> RunSummary {
        RunSummary {
            steps: 200,
            final_loss: 2.5,
            final_val_loss: Some(2.75),
            oom_recoveries: 0,
            oom_escalations: 0,
            configured_micro_batch: 8,
            final_micro_batch: 8,
            time_lost_s: 0.0,
            guard_overhead_s: 0.0,
            elapsed_s: 7200.0,
            tokens_per_s: 1.0,
            session_steps: 200,
            session_elapsed_s: 7200.0,
            peak_mapped_above_start_bytes: None,
            peak_resident_above_start_bytes: None,
        }
    }

    #[test]
    fn events_map_to_their_notify_on_names() {
        let stopped = |reason| Event::Stopped { step: 3, reason, checkpoint: None };
        assert_eq!(name_of(&Event::RunFinished(summary())).as_deref(), Some("finished"));
        assert_eq!(name_of(&stopped(StopReason::Signal)).as_deref(), Some("stopped"));
        assert_eq!(name_of(&stopped(StopReason::TimeLimit)).as_deref(), Some("stopped"));
        // These stops end the process with exit 3, 5 or 1: its `crashed` notice says so.
        for reason in [StopReason::OutOfMemory, StopReason::Nonfinite, StopReason::BadData] {
            assert_eq!(name_of(&stopped(reason)), None, "{reason}");
        }
        let escalated = Event::OomEscalated {
            step: 4,
            micro_batch: 1,
            level: 1,
            switched_on: "activation_checkpointing".into(),
            effect: "blocks recomputed".into(),
        };
        assert_eq!(name_of(&escalated).as_deref(), Some("escalated"));
        // Every other event by its events.jsonl name: a new kind needs no code here.
        let failed = Event::CheckpointFailed { step: 5, error: "disk full".into(), training_goes_on: true };
        assert_eq!(name_of(&failed).as_deref(), Some("checkpoint_failed"));
        assert_eq!(
            name_of(&Event::LeakSuspected { step: 1, message: "m".into() }).as_deref(),
            Some("leak_suspected")
        );
        // The names it gives are the ones notify.on accepts.
        for e in [&failed, &escalated] {
            let name = name_of(e).unwrap();
            assert!(crate::config::notify::NOTIFY_NAMES.contains(&name.as_str()), "{name}");
        }
    }

    #[test]
    fn the_body_has_slack_discord_and_ntfy_fields_with_the_same_line() {
        let n = Notice::of_event("finished".into(), &Event::RunFinished(summary()));
        let b = n.body("runs/gpt2", "node7");
        assert_eq!(
            b["text"],
            "runs/gpt2 on node7: finished 200 steps, loss 2.5000, validation 2.7500 in 2.0 h"
        );
        assert_eq!(b["content"], b["text"]);
        assert_eq!(b["title"], "trainguard runs/gpt2: finished");
        assert_eq!(b["event"], "finished");
        assert_eq!(b["step"], 200);
        assert_eq!(b["exit_code"], Value::Null);
        assert_eq!(b["details"]["event"], "run_finished");
        assert_eq!(b["details"]["final_loss"], 2.5);
    }

    #[test]
    fn a_crash_names_its_exit_code_and_a_long_message_is_cut_for_discord() {
        let long = format!("out of memory at step 1 at micro-batch 1\n{}", "x".repeat(5000));
        let n = Notice::crashed(3, "OutOfMemoryError", &long);
        let b = n.body("runs/a", "h");
        let text = b["text"].as_str().unwrap();
        assert_eq!(
            text,
            "runs/a on h: crashed, exit 3 (OutOfMemoryError): out of memory at step 1 at micro-batch 1"
        );
        assert_eq!(b["exit_code"], 3);
        assert_eq!(b["details"]["message"], long.as_str());
        let wide = Notice { headline: "y".repeat(3000), ..n };
        let text = wide.body("r", "h")["content"].as_str().unwrap().to_string();
        assert_eq!(text.chars().count(), MAX_TEXT_CHARS);
        assert!(text.ends_with('…'));
    }

    #[test]
    fn a_stop_says_whether_it_can_be_resumed() {
        let e = Event::Stopped { step: 7, reason: StopReason::Signal, checkpoint: Some("c".into()) };
        let n = Notice::of_event("stopped".into(), &e);
        assert_eq!(n.headline, "stopped after step 7 (signal); checkpointed, --resume auto continues");
        assert_eq!(n.step, Some(7));
    }
}
