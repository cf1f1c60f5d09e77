//! Block-wise 8-bit storage of optimizer moments: each block of [`BLOCK`] values keeps one fp32
//! absmax scale and one byte per value. Owns the two codes and their round trips; not the update
//! rule (see `adamw8bit`). All functions work in place on caller-provided buffers viewed as
//! `[blocks, block_len]`, so quantising allocates nothing the size of a block run.
//!
//! The codes are square-root companding rather than linear, because a linear byte per block
//! rounds every value below absmax/255 to zero, and moments within a block span several orders
//! of magnitude (a block of the embedding mixes frequent and rare tokens):
//! - first moment m, signed int8: q = round(127 · sign(m) · √(|m|/absmax)); values down to
//!   absmax/127² ≈ 6e-5·absmax survive (linear: absmax/127), at worst 1/|q| relative error.
//! - second moment v ≥ 0, uint8: q = round(255 · (v/absmax)^¼), i.e. √v — the quantity the
//!   update divides by — on the same square-root code as m; v down to 2e-10·absmax survives.
//!   Keeping small v away from zero matters more than for m: a v rounded to 0 under a non-zero m
//!   would turn the step m/(√v + eps) into m/eps.
//!
//! bitsandbytes uses a "dynamic" (floating-point-like) 256-entry code for the same reason; these
//! power codes get most of that dynamic range from elementwise ops alone (no table lookups, no
//! index buffers).
use tch::{Kind, TchError, Tensor};

/// Values per block (one absmax scale each), as bitsandbytes.
pub const BLOCK: i64 = 2048;
/// Tensors with fewer elements keep fp32 moments (the scales would not pay for themselves).
pub const MIN_QUANTISED: i64 = 4096;
/// An all-zero block gets this scale instead of 0, so that quantising divides by a finite number.
const TINY: f64 = 1e-30;

/// `(first element, elements, first block, blocks)` of the pieces a quantised tensor of `numel`
/// values is processed in: runs of at most `chunk_blocks` whole blocks, then the partial last
/// block (if any) on its own, viewed as one block of its length.
pub fn chunks(numel: i64, chunk_blocks: i64) -> Vec<(i64, i64, i64, i64)> {
    let whole = numel / BLOCK;
    let mut out: Vec<_> = (0..whole)
        .step_by(chunk_blocks.max(1) as usize)
        .map(|b0| {
            let nb = chunk_blocks.min(whole - b0);
            (b0 * BLOCK, nb * BLOCK, b0, nb)
        })
        .collect();
    if numel % BLOCK != 0 {
        out.push((whole * BLOCK, numel % BLOCK, whole, 1));
    }
    out
}

/// Number of absmax scales for `numel` values.
pub fn blocks(numel: i64) -> i64 {
    (numel + BLOCK - 1) / BLOCK
}

/// Writes the signed code of `x` (fp32, `[nb, len]`) into `q` (int8, same shape) and each row's
/// absmax into `absmax` (fp32, `[nb, 1]`). Destroys `x`; `tmp` is fp32 scratch of `x`'s shape.
pub fn quantise_signed(
    x: &mut Tensor,
    q: &Tensor,
    absmax: &mut Tensor,
    tmp: &mut Tensor,
) -> Result<(), TchError> {
    let _ = x.f_abs_out(tmp)?;
    let _ = tmp.f_amax_out(absmax, [1], true)?;
    let _ = absmax.f_clamp_min_(TINY)?;
    let _ = tmp.f_div_(absmax)?;
    let _ = tmp.f_sqrt_()?;
    let _ = tmp.f_mul_scalar_(127.0)?;
    let _ = x.f_sign_()?;
    let _ = x.f_mul_(tmp)?;
    // |x| ≤ absmax, so the code is within ±127 before rounding: the cast cannot wrap.
    let _ = x.f_round_()?;
    q.shallow_clone().f_copy_(x)?;
    Ok(())
}

/// Inverse of [`quantise_signed`]: `x = sign(q) · (q/127)² · absmax`. `tmp` is fp32 scratch.
pub fn dequantise_signed(
    q: &Tensor,
    absmax: &Tensor,
    x: &mut Tensor,
    tmp: &mut Tensor,
) -> Result<(), TchError> {
    x.f_copy_(q)?;
    let _ = x.f_abs_out(tmp)?;
    let _ = x.f_mul_(tmp)?;
    let _ = x.f_mul_(absmax)?;
    let _ = x.f_div_scalar_(127.0 * 127.0)?;
    Ok(())
}

/// Writes the unsigned code of `x` (fp32, ≥ 0, `[nb, len]`) into `q` (uint8) and each row's
/// absmax into `absmax` (`[nb, 1]`). Destroys `x`.
pub fn quantise_unsigned(x: &mut Tensor, q: &Tensor, absmax: &mut Tensor) -> Result<(), TchError> {
    let _ = x.f_amax_out(absmax, [1], true)?;
    let _ = absmax.f_clamp_min_(TINY)?;
    let _ = x.f_div_(absmax)?;
    let _ = x.f_sqrt_()?;
    let _ = x.f_sqrt_()?;
    let _ = x.f_mul_scalar_(255.0)?;
    // 0 ≤ x/absmax ≤ 1, so the code is within [0, 255] before rounding.
    let _ = x.f_round_()?;
    q.shallow_clone().f_copy_(x)?;
    Ok(())
}

/// Inverse of [`quantise_unsigned`]: `x = (q/255)⁴ · absmax`.
pub fn dequantise_unsigned(q: &Tensor, absmax: &Tensor, x: &mut Tensor) -> Result<(), TchError> {
    x.f_copy_(q)?;
    let _ = x.f_div_scalar_(255.0)?;
    let _ = x.f_square_()?;
    let _ = x.f_square_()?;
    let _ = x.f_mul_(absmax)?;
    Ok(())
}

/// Zeroed storage for `numel` values of one moment: codes of `kind` and fp32 scales.
pub fn zeros(numel: i64, kind: Kind, device: tch::Device) -> Result<(Tensor, Tensor), TchError> {
    Ok((Tensor::f_zeros([numel], (kind, device))?, Tensor::f_zeros([blocks(numel)], (Kind::Float, device))?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// 4 blocks of values spanning 10 orders of magnitude, both signs, plus an all-zero block.
    fn sample() -> Tensor {
        let mut v: Vec<f32> = (0..3 * BLOCK)
            .map(|i| {
                let mag = 10f64.powf(-10.0 * ((i * 7919) % 1000) as f64 / 1000.0);
                (if i % 3 == 0 { -mag } else { mag }) as f32
            })
            .collect();
        v.extend(std::iter::repeat_n(0.0, BLOCK as usize));
        Tensor::from_slice(&v).view([4, BLOCK])
    }

    fn round_trip(signed: bool, x: &Tensor) -> (Tensor, Tensor) {
        let x = if signed { x.shallow_clone() } else { x.abs() };
        let mut work = x.copy();
        let mut tmp = x.empty_like();
        let q = Tensor::zeros(x.size(), (if signed { Kind::Int8 } else { Kind::Uint8 }, Device::Cpu));
        let mut absmax = Tensor::zeros([4, 1], (Kind::Float, Device::Cpu));
        let mut back = x.empty_like();
        if signed {
            quantise_signed(&mut work, &q, &mut absmax, &mut tmp).unwrap();
            dequantise_signed(&q, &absmax, &mut back, &mut tmp).unwrap();
        } else {
            quantise_unsigned(&mut work, &q, &mut absmax).unwrap();
            dequantise_unsigned(&q, &absmax, &mut back).unwrap();
        }
        (x, back)
    }

    /// The code of √|x| is uniform with step 1/127 (signed) or 1/255 (of ⁴√v, unsigned), so
    /// |√(|x̂|/A) − √(|x|/A)| ≤ 1/254 for m, which bounds |x̂ − x| ≤ A·(2√(|x|/A) + 1/254)/254;
    /// and |√v̂ − √v| ≤ √A·(2·⁴√(v/A) + 1/510)/510 for v. Both asserted elementwise (with 1e-4
    /// relative slack: fp32 rounding of the code before `round` can move it ~4e-5 of a step past
    /// the half-way point), as are a zero block staying zero and signs kept.
    #[test]
    fn round_trips_have_bounded_error() {
        let x = sample();
        let a = x.abs().amax([1], true);
        let (m, m_hat) = round_trip(true, &x);
        let ratio = (&m.abs() / a.clamp_min(TINY)).sqrt();
        let bound = &a * (ratio * 2.0 + 1.0 / 254.0) / 254.0 * (1.0 + 1e-4) + 1e-37;
        let err = (&m_hat - &m).abs();
        assert!(
            bool::try_from(err.le_tensor(&bound).all()).unwrap(),
            "m: worst error/bound {}",
            f64::try_from((&err / &bound).max()).unwrap()
        );
        assert!(bool::try_from((m_hat.sign() * m.sign()).ge(0.0).all()).unwrap(), "a sign flipped");
        let (v, v_hat) = round_trip(false, &x);
        let (s, s_hat) = (v.sqrt(), v_hat.sqrt());
        let fourth = (&v / a.clamp_min(TINY)).sqrt().sqrt();
        let bound = a.sqrt() * (fourth * 2.0 + 1.0 / 510.0) / 510.0 * (1.0 + 1e-4) + 1e-37;
        let err = (&s_hat - &s).abs();
        assert!(
            bool::try_from(err.le_tensor(&bound).all()).unwrap(),
            "√v: worst error/bound {}",
            f64::try_from((&err / &bound).max()).unwrap()
        );
        assert_eq!(f64::try_from(v_hat.get(3).abs().max()).unwrap(), 0.0, "a zero block stays zero");
        // The largest value of each block comes back to within fp32 rounding.
        let top = (v_hat.amax([1], true) - v.amax([1], true)).abs() / a.clamp_min(TINY);
        assert!(f64::try_from(top.max()).unwrap() < 1e-6);
        // Small values survive: everything above 1e-8·absmax is non-zero after the round trip.
        let small = v.gt_tensor(&(&a * 1e-8)).logical_and(&v_hat.eq(0.0));
        assert!(
            !bool::try_from(small.any()).unwrap(),
            "a second moment above 1e-8·absmax was rounded to zero"
        );
    }

    #[test]
    fn chunks_cover_whole_blocks_then_the_tail() {
        assert_eq!(
            chunks(5 * BLOCK + 7, 2),
            [
                (0, 2 * BLOCK, 0, 2),
                (2 * BLOCK, 2 * BLOCK, 2, 2),
                (4 * BLOCK, BLOCK, 4, 1),
                (5 * BLOCK, 7, 5, 1)
            ]
        );
        assert_eq!(chunks(2 * BLOCK, 8), [(0, 2 * BLOCK, 0, 2)]);
        assert_eq!(blocks(2 * BLOCK + 1), 3);
    }
}
