//! A small host tensor for activations and gradients: a shape and a row-major [`HostBuffer`] of
//! any element type, with the batch-dimension split (torch's `tensor_split` remainder rule or
//! per-sample split metadata), concatenation, narrowing and element-wise sums the bridges need.

use crate::error::{Error, Result};
use crate::pool::BufferPool;
use grid_core::{Bool, DType, Element, HostBuffer, HostSlice, HostSliceMut};
use half::{bf16, f16};
use std::ops::Range;
use std::sync::{Arc, Weak};

/// A row-major host tensor of any [`DType`], optionally carrying per-sample split sizes for the
/// bridge (Megatron's `_mimo_bridge_split_sizes` attribute; it is local metadata and does not
/// travel).
///
/// A tensor that a bridge or pipeline communicator returned remembers that communicator's
/// [`BufferPool`]: when it is dropped its buffer goes back there and the next receive reuses it
/// instead of allocating (and page-faulting) a new one, as torch's caching allocator does for
/// Megatron. Clones and tensors built by the user have no pool;
/// [`Activation::into_data`] takes the buffer out for good.
///
/// ```
/// use multimodule::Activation;
/// let t = Activation::from_vec(vec![4, 2], (0..8).map(|x| x as f32).collect()).unwrap();
/// let parts = t.split_along(0, &[3, 1]).unwrap();
/// assert_eq!(parts[1].to_vec::<f32>().unwrap(), vec![6.0, 7.0]);
/// let back = multimodule::Activation::concat(&parts, 0).unwrap();
/// assert_eq!(back, t);
/// ```
#[derive(Debug)]
pub struct Activation {
    shape: Vec<usize>,
    data: HostBuffer,
    split_sizes: Option<Vec<usize>>,
    /// Where the buffer goes when the tensor is dropped.
    home: Option<Weak<BufferPool>>,
}

impl Clone for Activation {
    /// A copy with its own buffer (and no pool).
    fn clone(&self) -> Activation {
        Activation {
            shape: self.shape.clone(),
            data: self.data.clone(),
            split_sizes: self.split_sizes.clone(),
            home: None,
        }
    }
}

impl PartialEq for Activation {
    /// Same shape, dtype, elements and split sizes (the pool does not matter).
    fn eq(&self, other: &Activation) -> bool {
        self.shape == other.shape
            && self.data == other.data
            && self.split_sizes == other.split_sizes
    }
}

impl Drop for Activation {
    fn drop(&mut self) {
        if let Some(pool) = self.home.take().and_then(|w| w.upgrade()) {
            pool.put_buffer(std::mem::replace(
                &mut self.data,
                HostBuffer::U8(Vec::new()),
            ));
        }
    }
}

/// The tensor-level entry of the pool, here rather than in `pool` so that `pool` depends on no
/// other module of this crate.
impl BufferPool {
    /// Keeps `t`'s buffer for a later receive.
    pub fn put(&self, t: Activation) {
        self.put_buffer(t.into_data());
    }
}

fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s))
}

impl Activation {
    /// A tensor of `shape` over `data` (row-major; the length must match).
    pub fn new(shape: Vec<usize>, data: HostBuffer) -> Result<Activation> {
        let n = numel(&shape).ok_or_else(|| Error::Tensor {
            op: "Activation::new",
            message: format!("shape {shape:?} has too many elements"),
        })?;
        if n != data.len() {
            return Err(Error::Tensor {
                op: "Activation::new",
                message: format!(
                    "shape {shape:?} needs {n} elements but the buffer has {}",
                    data.len()
                ),
            });
        }
        Ok(Activation {
            shape,
            data,
            split_sizes: None,
            home: None,
        })
    }
    /// A tensor over a typed vector.
    pub fn from_vec<T: Element>(shape: Vec<usize>, data: Vec<T>) -> Result<Activation> {
        Activation::new(shape, T::owned(data))
    }
    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Result<Activation> {
        let n = numel(&shape).ok_or_else(|| Error::Tensor {
            op: "Activation::zeros",
            message: format!("shape {shape:?} has too many elements"),
        })?;
        Activation::new(shape, HostBuffer::zeros(dtype, n))
    }
    /// The same tensor carrying per-sample split sizes for the bridge's batch split.
    pub fn with_split_sizes(mut self, sizes: Vec<usize>) -> Activation {
        self.split_sizes = Some(sizes);
        self
    }
    /// The per-sample split sizes, if any.
    pub fn split_sizes(&self) -> Option<&[usize]> {
        self.split_sizes.as_deref()
    }
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.data.len() * self.dtype().size_bytes()
    }
    /// The buffer.
    pub fn data(&self) -> &HostBuffer {
        &self.data
    }
    /// The buffer, mutably (the length cannot change).
    pub fn data_mut(&mut self) -> HostSliceMut<'_> {
        self.data.as_mut_slice()
    }
    /// Takes the buffer (it then never goes back to a pool).
    pub fn into_data(mut self) -> HostBuffer {
        self.home = None;
        std::mem::replace(&mut self.data, HostBuffer::U8(Vec::new()))
    }
    /// Whether the buffer goes back to a communicator's pool when the tensor is dropped.
    ///
    /// ```
    /// let t = multimodule::Activation::from_vec(vec![2], vec![1u8, 2]).unwrap();
    /// assert!(!t.is_pooled()); // built here, not received
    /// assert!(!t.detach().is_pooled());
    /// ```
    pub fn is_pooled(&self) -> bool {
        self.home.as_ref().is_some_and(|w| w.strong_count() > 0)
    }
    /// Detaches the tensor from its pool: its buffer is freed normally when it is dropped.
    pub fn detach(mut self) -> Activation {
        self.home = None;
        self
    }
    /// The buffer goes to `pool` when the tensor is dropped.
    pub(crate) fn pooled(mut self, pool: &Arc<BufferPool>) -> Activation {
        self.home = Some(Arc::downgrade(pool));
        self
    }
    /// The elements as a typed slice, if the dtype is `T`.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        T::view(self.data.as_slice())
    }
    /// The elements as a typed vector.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.as_slice::<T>()
            .map(<[T]>::to_vec)
            .ok_or_else(|| Error::Tensor {
                op: "Activation::to_vec",
                message: format!("the tensor holds {}, not {}", self.dtype(), T::DTYPE),
            })
    }

    fn check_dim(&self, op: &'static str, dim: usize) -> Result<()> {
        if dim < self.shape.len() {
            Ok(())
        } else {
            Err(Error::Tensor {
                op,
                message: format!("dimension {dim} is out of range for shape {:?}", self.shape),
            })
        }
    }

    /// (outer, rows, inner) around `dim`.
    fn layout(&self, dim: usize) -> (usize, usize, usize) {
        let outer = self.shape[..dim].iter().product();
        let inner = self.shape[dim + 1..].iter().product();
        (outer, self.shape[dim], inner)
    }

    /// The element range of rows `rows` along `dim`, if those rows are contiguous in memory
    /// (every dimension before `dim` has size 1).
    pub fn contiguous_range(&self, dim: usize, rows: Range<usize>) -> Option<Range<usize>> {
        if dim >= self.shape.len() || rows.end > self.shape[dim] {
            return None;
        }
        let (outer, _, inner) = self.layout(dim);
        (outer == 1 || rows.is_empty()).then(|| rows.start * inner..rows.end * inner)
    }

    /// Splits along `dim` into parts of `sizes` rows (which must add up to the dimension).
    pub fn split_along(&self, dim: usize, sizes: &[usize]) -> Result<Vec<Activation>> {
        self.split_along_with(dim, sizes, &HostBuffer::zeros)
    }

    /// [`Activation::split_along`] into buffers from `alloc` (whose contents are overwritten).
    pub(crate) fn split_along_with(
        &self,
        dim: usize,
        sizes: &[usize],
        alloc: &dyn Fn(DType, usize) -> HostBuffer,
    ) -> Result<Vec<Activation>> {
        self.check_dim("split_along", dim)?;
        let total: usize = sizes.iter().sum();
        if total != self.shape[dim] {
            return Err(Error::Tensor {
                op: "split_along",
                message: format!(
                    "split sizes {sizes:?} add up to {total}, but dimension {dim} of shape {:?} has {}",
                    self.shape, self.shape[dim]
                ),
            });
        }
        let (outer, rows, inner) = self.layout(dim);
        let mut out = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &n in sizes {
            let mut data = alloc(self.dtype(), outer * n * inner);
            copy_rows(
                self.data.as_slice(),
                (rows, start),
                data.as_mut_slice(),
                (n, 0),
                (outer, n, inner),
            )?;
            let mut shape = self.shape.clone();
            shape[dim] = n;
            out.push(Activation {
                shape,
                data,
                split_sizes: None,
                home: None,
            });
            start += n;
        }
        Ok(out)
    }

    /// Rows `start .. start + len` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Activation> {
        self.narrow_with(dim, start, len, &HostBuffer::zeros)
    }

    /// [`Activation::narrow`] into a buffer from `alloc` (only the kept rows are copied).
    pub(crate) fn narrow_with(
        &self,
        dim: usize,
        start: usize,
        len: usize,
        alloc: &dyn Fn(DType, usize) -> HostBuffer,
    ) -> Result<Activation> {
        self.check_dim("narrow", dim)?;
        let n = self.shape[dim];
        if start.checked_add(len).is_none_or(|e| e > n) {
            return Err(Error::Tensor {
                op: "narrow",
                message: format!(
                    "rows {start}..{} are out of range 0..{n}",
                    start.saturating_add(len)
                ),
            });
        }
        let (outer, rows, inner) = self.layout(dim);
        let mut data = alloc(self.dtype(), outer * len * inner);
        copy_rows(
            self.data.as_slice(),
            (rows, start),
            data.as_mut_slice(),
            (len, 0),
            (outer, len, inner),
        )?;
        let mut shape = self.shape.clone();
        shape[dim] = len;
        Ok(Activation {
            shape,
            data,
            split_sizes: None,
            home: None,
        })
    }

    /// Concatenates `parts` along `dim`; they must share the dtype and every other dimension.
    pub fn concat(parts: &[Activation], dim: usize) -> Result<Activation> {
        let refs: Vec<&Activation> = parts.iter().collect();
        Activation::concat_with(&refs, dim, &HostBuffer::zeros)
    }

    /// The shape of `shapes` concatenated along `dim`, if they fit together.
    pub(crate) fn concat_shape(shapes: &[&[usize]], dim: usize) -> Option<Vec<usize>> {
        let first = shapes.first()?;
        if dim >= first.len() {
            return None;
        }
        let mut shape = first.to_vec();
        shape[dim] = 0;
        for p in shapes {
            let same_rest = p.len() == first.len()
                && p.iter()
                    .zip(first.iter())
                    .enumerate()
                    .all(|(d, (a, b))| d == dim || a == b);
            if !same_rest {
                return None;
            }
            shape[dim] += p[dim];
        }
        Some(shape)
    }

    /// [`Activation::concat`] of borrowed parts into a buffer from `alloc`.
    pub(crate) fn concat_with(
        parts: &[&Activation],
        dim: usize,
        alloc: &dyn Fn(DType, usize) -> HostBuffer,
    ) -> Result<Activation> {
        let first = parts.first().ok_or_else(|| Error::Tensor {
            op: "concat",
            message: "nothing to concatenate".into(),
        })?;
        first.check_dim("concat", dim)?;
        let shapes: Vec<&[usize]> = parts.iter().map(|p| p.shape()).collect();
        let shape = match Activation::concat_shape(&shapes, dim) {
            Some(s) if parts.iter().all(|p| p.dtype() == first.dtype()) => s,
            _ => {
                let p = parts
                    .iter()
                    .find(|p| {
                        p.dtype() != first.dtype()
                            || Activation::concat_shape(&[first.shape(), p.shape()], dim).is_none()
                    })
                    .unwrap_or(first);
                return Err(Error::Tensor {
                    op: "concat",
                    message: format!(
                        "cannot concatenate {} {:?} with {} {:?} along dimension {dim}",
                        first.dtype(),
                        first.shape,
                        p.dtype(),
                        p.shape
                    ),
                });
            }
        };
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let total = numel(&shape).unwrap_or(0);
        let mut out = alloc(first.dtype(), total);
        let mut col = 0usize;
        for p in parts {
            let rows = p.shape[dim];
            copy_rows(
                p.data.as_slice(),
                (rows, 0),
                out.as_mut_slice(),
                (shape[dim], col),
                (outer, rows, inner),
            )?;
            col += rows;
        }
        Ok(Activation {
            shape,
            data: out,
            split_sizes: None,
            home: None,
        })
    }

    /// Adds `other` element-wise (same dtype and shape).
    pub fn add_assign(&mut self, other: &Activation) -> Result<()> {
        if other.shape != self.shape || other.dtype() != self.dtype() {
            return Err(Error::Tensor {
                op: "add_assign",
                message: format!(
                    "cannot add {} {:?} to {} {:?}",
                    other.dtype(),
                    other.shape,
                    self.dtype(),
                    self.shape
                ),
            });
        }
        add_into(self.data.as_mut_slice(), other.data.as_slice())
    }
}

/// Copies `n` rows per outer index: rows `src_col..src_col + n` of a `[outer, src_rows, inner]`
/// buffer into rows `dst_col..dst_col + n` of a `[outer, dst_rows, inner]` buffer (same dtype).
fn copy_rows(
    src: HostSlice<'_>,
    (src_rows, src_col): (usize, usize),
    dst: HostSliceMut<'_>,
    (dst_rows, dst_col): (usize, usize),
    (outer, n, inner): (usize, usize, usize),
) -> Result<()> {
    fn go<T: Copy>(
        s: &[T],
        d: &mut [T],
        src: (usize, usize),
        dst: (usize, usize),
        dims: (usize, usize, usize),
    ) {
        let (outer, n, inner) = dims;
        if outer == 1 || (src.0 == n && dst.0 == n) {
            // One contiguous block.
            let (from, to) = (src.1 * inner, dst.1 * inner);
            let len = outer * n * inner;
            d[to..to + len].copy_from_slice(&s[from..from + len]);
            return;
        }
        for o in 0..outer {
            let from = (o * src.0 + src.1) * inner;
            let to = (o * dst.0 + dst.1) * inner;
            d[to..to + n * inner].copy_from_slice(&s[from..from + n * inner]);
        }
    }
    let (sc, dc, dims) = ((src_rows, src_col), (dst_rows, dst_col), (outer, n, inner));
    match (src, dst) {
        (HostSlice::F32(s), HostSliceMut::F32(d)) => go(s, d, sc, dc, dims),
        (HostSlice::F64(s), HostSliceMut::F64(d)) => go(s, d, sc, dc, dims),
        (HostSlice::I32(s), HostSliceMut::I32(d)) => go(s, d, sc, dc, dims),
        (HostSlice::I64(s), HostSliceMut::I64(d)) => go(s, d, sc, dc, dims),
        (HostSlice::U8(s), HostSliceMut::U8(d)) => go(s, d, sc, dc, dims),
        (HostSlice::F16(s), HostSliceMut::F16(d)) => go(s, d, sc, dc, dims),
        (HostSlice::BF16(s), HostSliceMut::BF16(d)) => go(s, d, sc, dc, dims),
        (s, d) => {
            return Err(Error::Tensor {
                op: "copy",
                message: format!("dtype {} into {}", s.dtype(), d.dtype()),
            })
        }
    }
    Ok(())
}

/// Cuts `s` into consecutive pieces of `lens` elements (their sum must not exceed its length).
pub(crate) fn chunks_mut<'a>(s: HostSliceMut<'a>, lens: &[usize]) -> Vec<HostSliceMut<'a>> {
    fn go<'a, T: Element>(mut v: &'a mut [T], lens: &[usize]) -> Vec<HostSliceMut<'a>> {
        let mut out = Vec::with_capacity(lens.len());
        for &n in lens {
            let at = n.min(v.len());
            let (head, tail) = std::mem::take(&mut v).split_at_mut(at);
            out.push(T::host_mut(head));
            v = tail;
        }
        out
    }
    dispatch!(HostSliceMut, s, v => go(v, lens))
}

fn add_into(dst: HostSliceMut<'_>, src: HostSlice<'_>) -> Result<()> {
    fn go<T: Copy>(d: &mut [T], s: &[T], f: impl Fn(T, T) -> T) {
        for (a, b) in d.iter_mut().zip(s) {
            *a = f(*a, *b);
        }
    }
    match (dst, src) {
        (HostSliceMut::F32(d), HostSlice::F32(s)) => go(d, s, |a, b| a + b),
        (HostSliceMut::F64(d), HostSlice::F64(s)) => go(d, s, |a, b| a + b),
        (HostSliceMut::I32(d), HostSlice::I32(s)) => go(d, s, i32::wrapping_add),
        (HostSliceMut::I64(d), HostSlice::I64(s)) => go(d, s, i64::wrapping_add),
        (HostSliceMut::U8(d), HostSlice::U8(s)) => go(d, s, u8::wrapping_add),
        (HostSliceMut::F16(d), HostSlice::F16(s)) => go(d, s, |a: f16, b: f16| a + b),
        (HostSliceMut::BF16(d), HostSlice::BF16(s)) => go(d, s, |a: bf16, b: bf16| a + b),
        (HostSliceMut::I8(d), HostSlice::I8(s)) => go(d, s, i8::wrapping_add),
        (HostSliceMut::U32(d), HostSlice::U32(s)) => go(d, s, u32::wrapping_add),
        (HostSliceMut::U64(d), HostSlice::U64(s)) => go(d, s, u64::wrapping_add),
        // The sum of booleans is their OR (as in every reduction of this workspace).
        (HostSliceMut::Bool(d), HostSlice::Bool(s)) => {
            go(d, s, |a: Bool, b: Bool| Bool::from(a.get() || b.get()))
        }
        (d, s) => {
            return Err(Error::Tensor {
                op: "add_assign",
                message: format!("dtype {} into {}", s.dtype(), d.dtype()),
            })
        }
    }
    Ok(())
}

/// `torch.tensor_split(n rows, k)`: the first `n mod k` parts get `⌈n/k⌉` rows, the rest
/// `⌊n/k⌋` (parts may be empty).
///
/// ```
/// assert_eq!(multimodule::tensor_split_sizes(7, 3), vec![3, 2, 2]);
/// assert_eq!(multimodule::tensor_split_sizes(2, 3), vec![1, 1, 0]);
/// ```
pub fn tensor_split_sizes(n: usize, k: usize) -> Vec<usize> {
    if k == 0 {
        return Vec::new();
    }
    (0..k).map(|i| n / k + usize::from(i < n % k)).collect()
}

/// Megatron's `_split_tensor_at_batch_dim` sizes: `k` parts of the `batch` rows, by
/// [`tensor_split_sizes`], or by per-sample metadata: with `k = 1` the whole batch; if the
/// metadata has more entries than `k` and a multiple of `k`, consecutive groups are summed; then
/// it must have exactly `k` entries summing to `batch`.
///
/// ```
/// use multimodule::batch_split_sizes;
/// assert_eq!(batch_split_sizes(6, 2, Some(&[0, 3, 1, 2])).unwrap(), vec![3, 3]);
/// assert!(batch_split_sizes(6, 2, Some(&[1, 2, 3])).is_err());
/// assert_eq!(batch_split_sizes(5, 2, None).unwrap(), vec![3, 2]);
/// ```
pub fn batch_split_sizes(batch: usize, k: usize, metadata: Option<&[usize]>) -> Result<Vec<usize>> {
    if k == 0 {
        return Err(Error::ZeroSplits { parts: k });
    }
    let Some(meta) = metadata else {
        return Ok(tensor_split_sizes(batch, k));
    };
    if k == 1 {
        return Ok(vec![batch]);
    }
    let sizes: Vec<usize> = if meta.len() > k && meta.len() % k == 0 {
        meta.chunks(meta.len() / k)
            .map(|c| c.iter().sum())
            .collect()
    } else {
        meta.to_vec()
    };
    if sizes.len() != k {
        return Err(Error::SplitMetadataCount {
            entries: sizes.len(),
            splits: k,
        });
    }
    let sum: usize = sizes.iter().sum();
    if sum != batch {
        return Err(Error::SplitMetadataSum { sizes, sum, batch });
    }
    Ok(sizes)
}

/// Megatron's `_split_tensor_at_batch_dim(t, k)`: splits along `batch_dim` by
/// [`batch_split_sizes`] (using the tensor's split metadata, if any).
///
/// ```
/// use multimodule::{split_at_batch_dim, Activation};
/// let t = Activation::from_vec(vec![2, 2, 2], vec![0u8; 8]).unwrap();
/// let shapes: Vec<Vec<usize>> = split_at_batch_dim(&t, 3, 0).unwrap().iter().map(|p| p.shape().to_vec()).collect();
/// assert_eq!(shapes, vec![vec![1, 2, 2], vec![1, 2, 2], vec![0, 2, 2]]);
/// ```
pub fn split_at_batch_dim(t: &Activation, k: usize, batch_dim: usize) -> Result<Vec<Activation>> {
    t.check_dim("split_at_batch_dim", batch_dim)?;
    let sizes = batch_split_sizes(t.shape[batch_dim], k, t.split_sizes())?;
    t.split_along(batch_dim, &sizes)
}

/// A sub-range of an erased host slice.
pub(crate) fn sub_slice(s: HostSlice<'_>, r: Range<usize>) -> HostSlice<'_> {
    dispatch!(HostSlice, s, v => T_slice(v, r))
}

#[allow(non_snake_case)]
fn T_slice<T: Element>(v: &[T], r: Range<usize>) -> HostSlice<'_> {
    T::host(&v[r])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_concat_middle_dim() {
        // [2, 3, 2] split along dim 1 into [2, 1]
        let t = Activation::from_vec(vec![2, 3, 2], (0..12).collect::<Vec<i64>>()).unwrap();
        let p = t.split_along(1, &[2, 1]).unwrap();
        assert_eq!(p[0].shape(), &[2, 2, 2]);
        assert_eq!(p[0].to_vec::<i64>().unwrap(), vec![0, 1, 2, 3, 6, 7, 8, 9]);
        assert_eq!(p[1].to_vec::<i64>().unwrap(), vec![4, 5, 10, 11]);
        assert_eq!(Activation::concat(&p, 1).unwrap(), t);
        assert_eq!(
            t.narrow(1, 1, 1).unwrap().to_vec::<i64>().unwrap(),
            vec![2, 3, 8, 9]
        );
        assert!(t.narrow(1, 2, 2).is_err());
        assert_eq!(t.contiguous_range(0, 1..2), Some(6..12));
        assert_eq!(t.contiguous_range(1, 1..2), None);
    }

    #[test]
    fn add_and_errors() {
        let mut a = Activation::from_vec(vec![2], vec![1.0f32, 2.0]).unwrap();
        a.add_assign(&Activation::from_vec(vec![2], vec![0.5f32, 0.5]).unwrap())
            .unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.5, 2.5]);
        assert!(a
            .add_assign(&Activation::from_vec(vec![2], vec![1i32, 2]).unwrap())
            .is_err());
        assert!(Activation::from_vec(vec![3], vec![1.0f32]).is_err());
        assert!(matches!(
            batch_split_sizes(3, 0, None),
            Err(Error::ZeroSplits { .. })
        ));
        assert!(matches!(
            batch_split_sizes(6, 2, Some(&[1, 1])),
            Err(Error::SplitMetadataSum { .. })
        ));
        assert_eq!(batch_split_sizes(6, 1, Some(&[1, 2])).unwrap(), vec![6]);
    }

    #[test]
    fn chunks_and_row_copies() {
        let mut b = HostBuffer::zeros(DType::I32, 7);
        let lens = [2, 0, 5];
        for (k, c) in chunks_mut(b.as_mut_slice(), &lens).into_iter().enumerate() {
            assert_eq!(c.len(), lens[k]);
            if let HostSliceMut::I32(v) = c {
                v.iter_mut().for_each(|x| *x = k as i32 + 1);
            }
        }
        assert_eq!(i32::from_owned(b).unwrap(), vec![1, 1, 3, 3, 3, 3, 3]);
        // [2, 3, 2]: narrow and split along the middle dim copy only the rows asked for.
        let t = Activation::from_vec(vec![2, 3, 2], (0..12).collect::<Vec<i64>>()).unwrap();
        let n = t.narrow_with(1, 1, 2, &HostBuffer::zeros).unwrap();
        assert_eq!(n.to_vec::<i64>().unwrap(), vec![2, 3, 4, 5, 8, 9, 10, 11]);
        let parts = t.split_along(1, &[0, 3]).unwrap();
        assert_eq!(parts[0].shape(), &[2, 0, 2]);
        assert_eq!(parts[1], t);
        let refs: Vec<&Activation> = parts.iter().collect();
        assert_eq!(
            Activation::concat_with(&refs, 1, &HostBuffer::zeros).unwrap(),
            t
        );
        assert_eq!(
            Activation::concat_shape(&[&[2, 1, 2], &[2, 3, 2]], 1),
            Some(vec![2, 4, 2])
        );
        assert_eq!(Activation::concat_shape(&[&[2, 1, 2], &[3, 3, 2]], 1), None);
    }

    #[test]
    fn sub_slices() {
        let s = [1.0f64, 2.0, 3.0];
        assert_eq!(sub_slice(f64::host(&s), 1..3).len(), 2);
    }
}
