//! Scoring multiple-choice examples by log-likelihood: each ending's tokens after the context's,
//! summed (`acc`) and per character of the ending (`acc_norm`, lm-eval's normalisation: it does
//! not depend on the tokenizer). The token layout (context, ending, the window the model sees)
//! and the choice are pure; [`score`] runs the model. Tokenizing is `encode.rs`'s.
use super::encode::Encoded;
use crate::model::Model;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

/// One example's scores, as `trainguard eval --scores` writes them (a line each).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExampleScore {
    /// The example's index in its file (blank lines not counted), from 0.
    pub index: usize,
    pub label: usize,
    /// Each ending's summed log-likelihood (natural log) given the context.
    pub sums: Vec<f64>,
    /// Each ending's token count.
    pub tokens: Vec<usize>,
    /// Each ending's characters (Unicode scalar values), its leading space included.
    pub chars: Vec<usize>,
    /// The ending with the highest sum, and with the highest sum per character (ties: the first).
    pub pred: usize,
    pub pred_norm: usize,
}

/// The model's input and targets for a context and an ending: the last `seq_len + 1` tokens of
/// the two together (a long context loses its start, as lm-eval truncates), and where the
/// ending's targets start among the targets. `None`: the ending alone is longer than the window.
pub fn window(context: &[i64], ending: &[i64], seq_len: usize) -> Option<(Vec<i64>, Vec<i64>, usize)> {
    if ending.len() > seq_len || ending.is_empty() || context.is_empty() {
        return None;
    }
    let all: Vec<i64> = context.iter().chain(ending).copied().collect();
    let kept = &all[all.len().saturating_sub(seq_len + 1)..];
    let (input, targets) = (kept[..kept.len() - 1].to_vec(), kept[1..].to_vec());
    let first = targets.len() - ending.len();
    Some((input, targets, first))
}

/// The index of the largest value, the first of equal ones (as numpy's argmax).
pub fn argmax(values: &[f64]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// The choice from each ending's summed log-likelihood and length in characters.
pub fn choose(sums: &[f64], chars: &[usize]) -> (usize, usize) {
    let per_char: Vec<f64> = sums.iter().zip(chars).map(|(s, &c)| s / c.max(1) as f64).collect();
    (argmax(sums), argmax(&per_char))
}

/// Scores one example: its endings in one forward pass (right-padded to the longest; padding
/// after a row's tokens does not change its causal logits), log-softmax in fp32.
pub fn score(
    model: &Model,
    e: &Encoded,
    seq_len: usize,
    device: Device,
) -> Result<ExampleScore, tch::TchError> {
    let windows: Vec<(Vec<i64>, Vec<i64>, usize)> = e
        .endings
        .iter()
        .map(|end| window(&e.context, end, seq_len).expect("encode.rs checked the lengths"))
        .collect();
    let width = windows.iter().map(|w| w.0.len()).max().unwrap_or(1);
    let (mut input, mut targets) = (Vec::new(), Vec::new());
    for (i, t, _) in &windows {
        let pad = width - i.len();
        input.extend(i.iter().copied().chain(std::iter::repeat_n(0, pad)));
        targets.extend(t.iter().copied().chain(std::iter::repeat_n(0, pad)));
    }
    let rows = windows.len() as i64;
    let x = Tensor::f_from_slice(&input)?.f_view([rows, width as i64])?.f_to_device(device)?;
    let y = Tensor::f_from_slice(&targets)?.f_view([rows, width as i64, 1])?.f_to_device(device)?;
    let logp = model
        .forward(&x, false, None)?
        .f_to_kind(Kind::Float)?
        .f_log_softmax(-1, Kind::Float)?
        .f_gather(-1, &y, false)?
        .f_view([rows * width as i64])?
        .f_to_kind(Kind::Double)?
        .f_to_device(Device::Cpu)?;
    let logp: Vec<f64> = Vec::try_from(&logp)?;
    let sums: Vec<f64> = windows
        .iter()
        .enumerate()
        .map(|(r, (_, t, first))| logp[r * width + first..r * width + t.len()].iter().sum())
        .collect();
    let (pred, pred_norm) = choose(&sums, &e.chars);
    Ok(ExampleScore {
        index: e.index,
        label: e.label,
        sums,
        tokens: e.endings.iter().map(Vec::len).collect(),
        chars: e.chars.clone(),
        pred,
        pred_norm,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_keeps_the_last_tokens_and_points_at_the_endings_targets() {
        let (i, t, first) = window(&[1, 2, 3], &[7, 8], 8).unwrap();
        assert_eq!((i, t, first), (vec![1, 2, 3, 7], vec![2, 3, 7, 8], 2));
        // seq_len 3: of 1 2 3 7 8 the last 4 tokens, the context's first lost.
        let (i, t, first) = window(&[1, 2, 3], &[7, 8], 3).unwrap();
        assert_eq!((i, t, first), (vec![2, 3, 7], vec![3, 7, 8], 1));
        // An ending as long as the window: the context's last token alone conditions it.
        let (i, t, first) = window(&[1, 2, 3], &[7, 8, 9], 3).unwrap();
        assert_eq!((i, t, first), (vec![3, 7, 8], vec![7, 8, 9], 0));
        assert_eq!(window(&[1], &[7, 8, 9, 10], 3), None, "longer than the window");
        assert_eq!(window(&[], &[7], 3), None, "nothing to condition on");
    }

    #[test]
    fn choices_by_sum_and_per_character_differ_where_length_matters() {
        // The long ending has the lowest sum but the best per-character score.
        let (pred, norm) = choose(&[-4.0, -9.0, -5.0], &[4, 30, 5]);
        assert_eq!((pred, norm), (0, 1));
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1, "the first of equal ones");
    }
}
