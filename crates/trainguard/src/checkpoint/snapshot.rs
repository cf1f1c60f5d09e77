//! The host copy a background checkpoint is written from: each tensor copied at the step
//! boundary into a host buffer (pinned when the tensors live on CUDA, so the device-to-host
//! copy runs at full speed), the buffers of the previous copy reused when every shape and
//! dtype still matches (allocating and first touching gigabytes costs as much as the copy).
//! What it does not own: writing ([`super::writer`]) or deciding when to copy.
use tch::{Device, Kind, Tensor};

/// Why a host copy could not be taken (out of host memory, most likely).
#[derive(Debug, thiserror::Error)]
#[error("no host copy of `{tensor}` ({bytes} bytes): {why}")]
pub struct CopyError {
    pub tensor: String,
    pub bytes: u64,
    pub why: String,
}

/// Copies `tensors` to host memory, into `spare`'s buffers where they fit. `pinned`: the CUDA
/// device the tensors are on (their buffers are page-locked for it). The copy is a sync point
/// with the device: the step's kernels finish before it returns, so it holds exactly the state
/// at this step boundary.
pub fn copy(
    tensors: &[(String, Tensor)],
    spare: Vec<(String, Tensor)>,
    pinned: Option<Device>,
) -> Result<Vec<(String, Tensor)>, CopyError> {
    let _no_grad = tch::no_grad_guard();
    // A run's device never changes: spare buffers are pinned alike.
    let fits = spare.len() == tensors.len()
        && spare
            .iter()
            .zip(tensors)
            .all(|((a, x), (b, y))| a == b && x.size() == y.size() && x.kind() == y.kind());
    let mut spare = if fits { spare.into_iter().map(|(_, t)| Some(t)).collect() } else { vec![] };
    spare.resize_with(tensors.len(), || None);
    tensors
        .iter()
        .zip(spare)
        .map(|((name, t), reuse)| {
            let fail = |why: String| CopyError { tensor: name.clone(), bytes: bytes(t), why };
            let buffer = match reuse {
                Some(b) => b,
                None => allocate(&t.size(), t.kind(), pinned).map_err(|e| fail(e.to_string()))?,
            };
            let mut dst = buffer.shallow_clone();
            dst.f_copy_(t).map_err(|e| fail(e.to_string()))?;
            Ok((name.clone(), buffer))
        })
        .collect()
}

fn allocate(size: &[i64], kind: Kind, pinned: Option<Device>) -> Result<Tensor, tch::TchError> {
    let host = Tensor::f_empty(size, (kind, Device::Cpu))?;
    match pinned {
        Some(device) => host.f_pin_memory(device),
        None => Ok(host),
    }
}

fn bytes(t: &Tensor) -> u64 {
    t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
}

/// Bytes a host copy of `tensors` holds.
pub fn size_of(tensors: &[(String, Tensor)]) -> u64 {
    tensors.iter().map(|(_, t)| bytes(t)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(v: &[f32]) -> Vec<(String, Tensor)> {
        vec![("w".into(), Tensor::from_slice(v)), ("b".into(), Tensor::from_slice(&[9.0f32]))]
    }

    #[test]
    fn the_copy_holds_the_values_of_its_moment_and_reuses_matching_buffers() {
        let live = named(&[1.0, 2.0]);
        let first = copy(&live, vec![], None).unwrap();
        let _ = live[0].1.shallow_clone().fill_(5.0); // training goes on
        assert_eq!(Vec::<f32>::try_from(&first[0].1).unwrap(), [1.0, 2.0], "not a view of the live tensor");
        let ptr = first[0].1.data_ptr();
        let second = copy(&live, first, None).unwrap();
        assert_eq!(second[0].1.data_ptr(), ptr, "the buffer was reused");
        assert_eq!(Vec::<f32>::try_from(&second[0].1).unwrap(), [5.0, 5.0]);
        // Another shape (8-bit state growing, a new optimizer): fresh buffers.
        let third = copy(&named(&[1.0, 2.0, 3.0]), second, None).unwrap();
        assert_eq!(third[0].1.size(), [3]);
        assert_eq!(size_of(&third), 16);
    }
}
