//! Gradient clipping by global L2 norm.
use tch::{TchError, Tensor};

/// Scales `grads` in place so their global L2 norm is at most `max_norm` (0 = no clipping) and
/// returns the norm before clipping. One host sync (the norm is read back).
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64, TchError> {
    let _no_grad = tch::no_grad_guard();
    let norms = grads.iter().map(|g| g.f_norm()).collect::<Result<Vec<_>, _>>()?;
    let total = Tensor::f_stack(&norms, 0)?.f_norm()?.f_double_value(&[])?;
    if max_norm > 0.0 && total.is_finite() {
        let coef = max_norm / (total + 1e-6);
        if coef < 1.0 {
            for g in grads.iter_mut() {
                let _ = g.f_mul_scalar_(coef)?;
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clips_to_the_global_norm_and_reports_the_original() {
        let mut g = vec![Tensor::from_slice(&[3.0f32]), Tensor::from_slice(&[4.0f32])];
        let n = clip_grad_norm(&mut g, 1.0).unwrap();
        assert!((n - 5.0).abs() < 1e-6);
        assert!((g[0].double_value(&[0]) - 0.6).abs() < 1e-5);
        assert!((g[1].double_value(&[0]) - 0.8).abs() < 1e-5);
        let mut g = vec![Tensor::from_slice(&[0.3f32])];
        clip_grad_norm(&mut g, 1.0).unwrap();
        assert!((g[0].double_value(&[0]) - 0.3).abs() < 1e-7, "below the limit nothing changes");
    }
}
