//! Turns the panics tch raises for libtorch errors back into errors, so an out-of-memory that
//! lands in the wrong op still reaches the guard instead of killing the process.
//!
//! Why it is needed: tch 0.24 panics, rather than returning `Err`, when a fallible op that takes a
//! `Scalar` (`f_lerp_`, `f_mul_scalar_`, `f_fill_`, …) fails: the temporary `Scalar` is dropped
//! while libtorch's error is still pending, and its drop unwraps that error
//! (`tch/src/wrappers/utils.rs`, `unsafe_torch_err!` + `scalar.rs`'s `Drop`). The infallible forms
//! (`mul`, `add`, …) panic on any error by design. Either way the panic's payload is
//! ``called `Result::unwrap()` on an `Err` value: Torch("<libtorch's message>")``: that message
//! is recovered here, so the guard's `classify` sees the same text a `TchError` would have carried.
//! Any other panic is a bug and is resumed untouched.
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;
use tch::TchError;

thread_local! {
    /// True while this thread runs inside [`catch_torch_panics`]: its libtorch panics are caught,
    /// so the panic hook must not print them as if the process were dying.
    static CATCHING: Cell<bool> = const { Cell::new(false) };
}

const UNWRAPPED_TORCH_ERROR: &str = "called `Result::unwrap()` on an `Err` value: Torch(\"";

/// Runs `f`; a libtorch error that tch raised as a panic comes back as `Err(TchError::Torch)`.
pub fn catch_torch_panics<T, E: From<TchError>>(f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    quiet_hook_installed();
    let outer = CATCHING.with(|c| c.replace(true));
    let outcome = panic::catch_unwind(AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(outer));
    match outcome {
        Ok(result) => result,
        Err(payload) => {
            let text = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied());
            match text.and_then(torch_message) {
                Some(message) => Err(E::from(TchError::Torch(message))),
                None => panic::resume_unwind(payload),
            }
        }
    }
}

/// libtorch's message inside a panic's text, unescaped, when the panic is an unwrapped
/// `TchError::Torch`.
fn torch_message(panic_text: &str) -> Option<String> {
    let start = panic_text.find(UNWRAPPED_TORCH_ERROR)? + UNWRAPPED_TORCH_ERROR.len();
    let end = panic_text.rfind("\")")?;
    (end >= start).then(|| unescape_debug(&panic_text[start..end]))
}

/// Undoes `{:?}`'s escaping of a string (the escapes `str::escape_debug` writes).
fn unescape_debug(escaped: &str) -> String {
    let mut out = String::with_capacity(escaped.len());
    let mut chars = escaped.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('0') => out.push('\0'),
            Some('u') => {
                // \u{XXXX}
                let code: String = chars.by_ref().skip(1).take_while(|&h| h != '}').collect();
                out.extend(u32::from_str_radix(&code, 16).ok().and_then(char::from_u32));
            }
            Some(other) => out.push(other), // \\ \" \'
            None => out.push('\\'),
        }
    }
    out
}

/// Wraps the current panic hook once: a libtorch panic raised inside [`catch_torch_panics`] is
/// not printed (it becomes an error the guard reports); every other panic prints as before.
fn quiet_hook_installed() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let caught =
                CATCHING.with(Cell::get) && info.payload_as_str().is_some_and(|t| torch_message(t).is_some());
            if !caught {
                previous(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scalar_op_that_fails_in_libtorch_comes_back_as_its_error() {
        // Real libtorch failure: lerp_ between tensors whose shapes cannot broadcast, through
        // tch's Scalar-taking fallible form (which panics in tch 0.24 instead of returning Err).
        let mut a = tch::Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu));
        let b = tch::Tensor::ones([4], (tch::Kind::Float, tch::Device::Cpu));
        // The tch defect this module exists for (if a tch release fixes it, this fails: then
        // the guard no longer needs the catch for these ops).
        let raw = panic::catch_unwind(AssertUnwindSafe(|| a.f_lerp_(&b, 0.5).map(|_| ())));
        assert!(raw.is_err(), "tch returned the error instead of panicking: {raw:?}");
        let err = catch_torch_panics(|| a.f_lerp_(&b, 0.5).map(|_| ())).unwrap_err();
        let TchError::Torch(message) = err else { panic!("expected a Torch error, got {err:?}") };
        assert!(message.contains("must match the size"), "libtorch's own text comes back: {message}");
        assert!(!message.contains("\\n"), "escapes are undone: {message}");
        // The tensor is still usable and libtorch holds no pending error afterwards.
        assert_eq!(
            a.f_add_(&tch::Tensor::ones([3], (tch::Kind::Float, tch::Device::Cpu)))
                .unwrap()
                .sum(tch::Kind::Float)
                .double_value(&[]),
            3.0
        );
    }

    #[test]
    fn an_infallible_op_that_fails_comes_back_as_its_error() {
        let a = tch::Tensor::zeros([2, 3], (tch::Kind::Float, tch::Device::Cpu));
        let b = tch::Tensor::zeros([4, 5], (tch::Kind::Float, tch::Device::Cpu));
        let err = catch_torch_panics::<(), TchError>(|| {
            let _ = a.matmul(&b);
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("cannot be multiplied"), "{err}");
    }

    #[test]
    fn other_panics_are_not_swallowed() {
        let outer =
            panic::catch_unwind(|| catch_torch_panics::<(), TchError>(|| panic!("a bug, not libtorch")));
        let payload = outer.expect_err("the bug's panic goes on");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"a bug, not libtorch"));
    }

    #[test]
    fn debug_escapes_are_undone() {
        let original = "line one\n\tquoted \"x\" back\\slash é \u{1F600}";
        let text =
            format!("called `Result::unwrap()` on an `Err` value: {:?}", TchError::Torch(original.into()));
        assert_eq!(torch_message(&text).as_deref(), Some(original));
        assert_eq!(torch_message("index out of bounds"), None);
    }
}
