//! The CUDA backend's [`LayerOps`]: the kernels of each op of a layer,
//! and which fused form a step takes. Decode batches keep the residual
//! stream in the projections (each norm applied by the product that reads
//! it, o and down adding their output into the residual, int4 products
//! handing the next norm's sums over); other batches run norm kernels with
//! the residual add fused in, and cuBLAS or the int4 GEMM.

use super::context::Inputs;
use super::{
    norm_threads, CudaFormats, CudaForward, CudaWeight, CudaWeights, PrefillKernel, ATTN_THREADS,
    DA_THREADS, TILE_THREADS,
};
use crate::backend::cuda::{
    self, DeviceBuffer, GemmDType, GemvFamily, GemvOut, GemvWeight, KArg, QkvEpilogue, W4Handoff,
    W4Matrix, W4Norm, W4Out, HANDOFF_ROWS,
};
use crate::backend::layer_ops::{Activations, LayerOps, LayerWeights, LmHead};
use crate::{Error, ErrorKind, Result};

/// Where a projection's input rows come from.
#[derive(Debug, Clone, Copy)]
pub enum ProjInput {
    /// Rows already normalized: in `normed`, or packed for the int4 GEMM
    /// in its scratch (`add_rms_norm_w4g`).
    Normed(LinearInput),
    /// The residual stream `hidden`, to normalize with this norm weight.
    Residual(u64),
    /// `normed` written by a norm handoff (`norm_handoff`): x · the norm
    /// weight, each row's sum of squares of x in `sums`; the product also
    /// clears `clear`, the next handoff's sums.
    Handoff { sums: u64, clear: u64 },
}

/// The activations a product multiplies.
#[derive(Debug, Clone, Copy)]
pub enum LinearInput {
    /// Rows at this address.
    Rows(u64),
    /// Their image packed for the int4 GEMM (as `w4_gemm_pack_x` packs),
    /// in its scratch: written by the kernel before the product.
    W4Packed,
}

impl LinearInput {
    /// The rows' address, for kernels that read rows.
    fn rows(self) -> Result<u64> {
        match self {
            LinearInput::Rows(x) => Ok(x),
            LinearInput::W4Packed => Err(Error::new(
                ErrorKind::Internal,
                "activations packed for the int4 GEMM went to a kernel that reads rows",
            )),
        }
    }
}

/// The kernels behind the ops, on the context's workspace.
impl CudaForward {
    /// `out[j] = rmsnorm(hidden[r] (+= delta[r])) * w` for `n` output rows;
    /// `rows` (a device list, or `KArg::Ptr(0)`) maps output rows to input rows.
    fn add_rms_norm(&self, n: u32, delta: u64, rows: KArg, w: u64, out: u64) -> Result<()> {
        let c = &self.model.dims;
        self.model.dev.launch(
            &self.model.dev.kernels.add_rms_norm,
            (n, 1, 1),
            norm_threads(c.hidden),
            &[
                KArg::Ptr(self.ws.hidden.ptr()),
                KArg::Ptr(delta),
                rows,
                KArg::Ptr(w),
                KArg::Ptr(out),
                KArg::I32(c.hidden as i32),
                KArg::F32(c.rms_norm_eps),
            ],
        )
    }

    /// `w`'s int4 matrix when a batch of `rows` rows runs through the int4
    /// kernels.
    fn w4_direct<'w>(&self, w: &'w CudaWeight, rows: usize) -> Option<&'w W4Matrix> {
        w.int4().filter(|_| rows <= self.model.w4_mma_rows)
    }

    /// The scratch of int4 batches above the fused kernels' rows.
    fn w4_scratch(&self) -> Result<u64> {
        let scratch = self.ws.w4_scratch.as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                "int4 batch above the kernel limit without its scratch",
            )
        })?;
        Ok(scratch.ptr())
    }

    /// The activations `m` multiplies (gathered for act-order weights).
    fn w4_input(&self, x: u64, rows: usize, m: &W4Matrix) -> Result<u64> {
        let scratch = self.ws.w4_x.as_ref().map_or(0, |b| b.ptr());
        self.model.dev.w4_input(x, rows, m, scratch)
    }

    /// `y = x · wᵀ (+ bias)` in the activation dtype.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        x: LinearInput,
        w: &CudaWeight,
        bias: Option<&DeviceBuffer<u16>>,
        y: u64,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let dev = &self.model.dev;
        match (w, x) {
            (CudaWeight::Int4(m), LinearInput::W4Packed) if self.model.w4_gemm_takes(rows) => {
                dev.w4_gemm_packed(rows, m, y, self.w4_scratch()?)?
            }
            (CudaWeight::Int4(m), LinearInput::Rows(x)) if self.model.w4_gemm_takes(rows) => {
                dev.w4_gemm(x, rows, m, y, self.w4_scratch()?)?
            }
            (CudaWeight::Dense(b), x) => {
                dev.gemm(x.rows()?, b.ptr(), y, rows, n, k, GemmDType::Act)?
            }
            (CudaWeight::Fp8(m), x) if dev.gemv_fits(rows, k) => dev.gemv(
                x.rows()?,
                GemvWeight::Fp8(m),
                y,
                (rows, n, k),
                GemvOut::Act,
                None,
            )?,
            (CudaWeight::Fp8(m), x) => {
                let dense = self.w4_scratch()?;
                dev.w8_dequant(m, dense)?;
                dev.gemm(x.rows()?, dense, y, rows, n, k, GemmDType::Act)?
            }
            (CudaWeight::Int4(m), x) => {
                let x = self.w4_input(x.rows()?, rows, m)?;
                if rows <= self.model.w4_mma_rows {
                    dev.w4_mm(x, rows, m, W4Out::Act { y }, W4Norm::None)?
                } else {
                    let dense = self.w4_scratch()?;
                    dev.w4_dequant(m, dense)?;
                    dev.gemm(x, dense, y, rows, n, k, GemmDType::Act)?
                }
            }
        }
        match bias {
            None => Ok(()),
            Some(b) => dev.launch(
                &dev.kernels.add_bias,
                (rows as u32, 1, 1),
                256,
                &[KArg::Ptr(y), KArg::Ptr(b.ptr()), KArg::I32(n as i32)],
            ),
        }
    }

    /// Whether a step of `rows` rows runs the residual stream through the
    /// projections: QKV and gate/up read the residual and norm it on the
    /// fly, o and down add their output into it (every projection a GEMV
    /// or an int4 MMA kernel that can, no o_proj bias to add).
    fn residual_in_projections(&self, rows: usize) -> bool {
        let m = &*self.model;
        let (c, dev) = (&m.dims, &*m.dev);
        let (d, nq, inter) = (c.hidden, c.heads * c.head_dim, c.intermediate);
        // FP8 GEMVs do not norm their input on the fly: per weight byte
        // that costs them twice the ALU work it costs 16-bit rows, and
        // made batch-1 FP8 decode slower than bf16 (H200, 8B shape: 187 vs
        // 205 tok/s); a norm kernel writes the rows once instead.
        let norms = |w: &CudaWeight, k: usize| match w {
            CudaWeight::Dense(_) => dev.gemv_fits(rows, k),
            CudaWeight::Fp8(_) => false,
            CudaWeight::Int4(q) => self.w4_direct(w, rows).is_some() && dev.w4_norm_fits(rows, q),
        };
        let adds = |w: &CudaWeight, k: usize| match w {
            CudaWeight::Dense(_) | CudaWeight::Fp8(_) => dev.gemv_fits(rows, k),
            CudaWeight::Int4(_) => self.w4_direct(w, rows).is_some(),
        };
        m.weights.layers.iter().all(|l| {
            l.o_bias.is_none()
                && norms(&l.qkv, d)
                && adds(&l.o, nq)
                && norms(&l.gate_up, d)
                && adds(&l.down, inter)
        })
    }

    /// `hidden[rows, n] += x · wᵀ`: the o and down projections when the
    /// residual stream runs through the projections; with `handoff` (int4
    /// only, see `norm_handoff`) also the next norm's input.
    fn add_to_residual(
        &self,
        x: u64,
        w: &CudaWeight,
        (rows, n, k): (usize, usize, usize),
        handoff: Option<W4Handoff>,
    ) -> Result<()> {
        let dev = &self.model.dev;
        let y = self.ws.hidden.ptr();
        match w {
            CudaWeight::Dense(_) | CudaWeight::Fp8(_) if handoff.is_some() => Err(Error::new(
                ErrorKind::Internal,
                "a norm handoff needs int4 o and down projections",
            )),
            CudaWeight::Dense(b) => dev.gemv(
                x,
                GemvWeight::Act(b.ptr()),
                y,
                (rows, n, k),
                GemvOut::ResidualAdd,
                None,
            ),
            CudaWeight::Fp8(m) => dev.gemv(
                x,
                GemvWeight::Fp8(m),
                y,
                (rows, n, k),
                GemvOut::ResidualAdd,
                None,
            ),
            CudaWeight::Int4(m) => {
                let x = self.w4_input(x, rows, m)?;
                dev.w4_mm(x, rows, m, W4Out::Residual { y, handoff }, W4Norm::None)
            }
        }
    }

    /// Whether a decode step of `rows` rows that keeps the residual stream
    /// in the projections (`residual_in_projections`) also hands each norm
    /// from the residual-adding product (o, down) to the next paired
    /// product (gate/up, the next layer's QKV): the int4 kernels'
    /// [`W4Handoff`], so those multiply ready rows instead of norming the
    /// residual themselves (H100, 8B shape: int4 decode +5-6 %).
    fn norm_handoff(&self, rows: usize) -> bool {
        self.model.w4_handoff && rows <= HANDOFF_ROWS
    }

    /// Sums of squares set `i % 2` (norm `i` of the step: 2·layer for the
    /// input norm, 2·layer + 1 for the post-attention norm).
    fn norm_sums(&self, i: usize) -> u64 {
        self.ws.norm_sums.ptr() + ((i % 2) * HANDOFF_ROWS * 8) as u64
    }

    /// The rows an int4 paired product reads and how it norms them.
    fn w4_projection_input(
        &self,
        input: ProjInput,
        rows: usize,
        m: &W4Matrix,
    ) -> Result<(u64, W4Norm)> {
        let eps = self.model.dims.rms_norm_eps;
        if let ProjInput::Handoff { sums, clear } = input {
            return Ok((self.ws.normed.ptr(), W4Norm::Sums { sums, eps, clear }));
        }
        let (x, norm) = self.projection_input(input, rows, self.model.dev.w4_norm_fits(rows, m))?;
        let norm = norm.map_or(W4Norm::None, |(weight, eps)| W4Norm::Stage { weight, eps });
        Ok((self.w4_input(x.rows()?, rows, m)?, norm))
    }

    /// The rows a projection reads (x) and the norm it applies on the fly:
    /// only the GEMV and small-batch int4 kernels can norm on the fly, so
    /// otherwise the residual is normed into `normed` first.
    fn projection_input(
        &self,
        input: ProjInput,
        rows: usize,
        fused: bool,
    ) -> Result<(LinearInput, Option<(u64, f32)>)> {
        let ws = &self.ws;
        match input {
            ProjInput::Normed(x) => Ok((x, None)),
            ProjInput::Handoff { .. } => Err(Error::new(
                ErrorKind::Internal,
                "a norm handoff goes to int4 paired products only",
            )),
            ProjInput::Residual(nw) if fused => Ok((
                LinearInput::Rows(ws.hidden.ptr()),
                Some((nw, self.model.dims.rms_norm_eps)),
            )),
            ProjInput::Residual(nw) => {
                self.add_rms_norm(rows as u32, 0, KArg::Ptr(0), nw, ws.normed.ptr())?;
                Ok((LinearInput::Rows(ws.normed.ptr()), None))
            }
        }
    }

    /// q, k, v of the input rows: q (with RoPE) into the QKV rows, k (with
    /// RoPE) and v into the layer's cache slots. Decode batches of models
    /// without q/k norms take one fused GEMV for all of it.
    fn qkv_rope_kv_write(
        &self,
        layer: &LayerWeights<CudaFormats>,
        inputs: &Inputs,
        (kc, vc): (u64, u64),
        input: ProjInput,
    ) -> Result<()> {
        let m = &*self.model;
        let (dev, c, ws) = (&*m.dev, &m.dims, &self.ws);
        let k = &dev.kernels;
        let (rows, d, hd) = (inputs.rows, c.hidden, c.head_dim);
        let r32 = rows as u32;
        let (nq, nkv) = (c.heads * hd, c.kv_heads * hd);
        let qkv_w = nq + 2 * nkv;
        let inp = |o: usize| KArg::Ptr(ws.inputs.at(o));
        if let Some(m) = self
            .w4_direct(&layer.qkv, rows)
            .filter(|_| layer.q_norm.is_none())
        {
            let (x, norm) = self.w4_projection_input(input, rows, m)?;
            let epilogue = QkvEpilogue {
                qkv: ws.qkv.ptr(),
                bias: layer.qkv_bias.as_ref().map_or(0, |b| b.ptr()),
                rope_cs: ws.rope_cs.ptr(),
                slots: ws.inputs.at(inputs.write_slots),
                k_cache: kc,
                v_cache: vc,
                kv_fp8: self.kv_fp8(),
                nq,
                nkv,
                head_dim: hd,
            };
            return dev.w4_mm(x, rows, m, W4Out::Qkv(epilogue), norm);
        }
        let fused = layer
            .qkv
            .gemv_weight()
            .filter(|_| dev.gemv_fits(rows, d) && layer.q_norm.is_none());
        let (x, norm) = self.projection_input(input, rows, fused.is_some())?;
        let (nw, eps) = norm.unwrap_or((0, 0.0));
        if let Some(qkv) = fused {
            return dev.launch_gemv(
                GemvFamily::QkvRope,
                qkv,
                qkv_w / 2,
                (rows, qkv_w, d),
                &[
                    KArg::Ptr(x.rows()?),
                    KArg::Ptr(qkv.ptr()),
                    KArg::Ptr(layer.qkv_bias.as_ref().map_or(0, |b| b.ptr())),
                    KArg::Ptr(ws.qkv.ptr()),
                    KArg::Ptr(ws.rope_cs.ptr()),
                    inp(inputs.write_slots),
                    KArg::Ptr(kc),
                    KArg::Ptr(vc),
                    KArg::I32(nq as i32),
                    KArg::I32(nkv as i32),
                    KArg::I32(hd as i32),
                    KArg::I32(d as i32),
                    KArg::I32(rows as i32),
                    KArg::Ptr(nw),
                    KArg::F32(eps),
                    KArg::I32(self.kv_fp8() as i32),
                ],
            );
        }
        self.linear(
            x,
            &layer.qkv,
            layer.qkv_bias.as_ref(),
            ws.qkv.ptr(),
            rows,
            qkv_w,
            d,
        )?;
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            for (w, offset, heads) in [(qn, 0, c.heads), (kn, nq, c.kv_heads)] {
                dev.launch(
                    &k.head_rms_norm,
                    (r32, heads as u32, 1),
                    32,
                    &[
                        KArg::Ptr(ws.qkv.ptr()),
                        KArg::Ptr(w.ptr()),
                        KArg::I32(qkv_w as i32),
                        KArg::I32(offset as i32),
                        KArg::I32(hd as i32),
                        KArg::F32(c.rms_norm_eps),
                    ],
                )?;
            }
        }
        // q and k heads are adjacent in the fused row: one pass over both.
        dev.launch(
            &k.rope,
            (r32, 1, 1),
            256,
            &[
                KArg::Ptr(ws.qkv.ptr()),
                KArg::Ptr(ws.rope_cs.ptr()),
                KArg::I32(qkv_w as i32),
                KArg::I32((c.heads + c.kv_heads) as i32),
                KArg::I32(hd as i32),
            ],
        )?;
        let kv_write = if self.kv_fp8() {
            &k.kv_write_fp8
        } else {
            &k.kv_write
        };
        dev.launch(
            kv_write,
            (r32, 1, 1),
            256,
            &[
                KArg::Ptr(ws.qkv.ptr()),
                KArg::I32(qkv_w as i32),
                KArg::I32(nq as i32),
                KArg::I32((nq + nkv) as i32),
                inp(inputs.write_slots),
                KArg::Ptr(kc),
                KArg::Ptr(vc),
                KArg::I32(nkv as i32),
            ],
        )
    }

    /// Attention of every row into `attn`: prompt chunks through the
    /// prefill kernel by tiles, the decode rows through the split decode
    /// kernel (and the merge of its splits).
    fn attend(&self, inputs: &Inputs, (kc, vc): (u64, u64), splits: usize) -> Result<()> {
        let m = &*self.model;
        let (dev, c, ws) = (&*m.dev, &m.dims, &self.ws);
        let k = &dev.kernels;
        let hd = c.head_dim;
        let qkv_w = (c.heads + 2 * c.kv_heads) * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let inp = |o: usize| KArg::Ptr(ws.inputs.at(o));
        if inputs.n_tiles > 0 {
            let kernel = match (m.prefill, self.kv_fp8()) {
                (PrefillKernel::Flash, false) => &k.attention_flash,
                (PrefillKernel::Flash, true) => &k.attention_flash_fp8,
                (_, false) => &k.attention_tiles,
                (_, true) => &k.attention_tiles_fp8,
            };
            dev.launch(
                kernel,
                (c.heads as u32, inputs.n_tiles as u32, 1),
                TILE_THREADS,
                &[
                    KArg::Ptr(ws.qkv.ptr()),
                    KArg::I32(qkv_w as i32),
                    KArg::Ptr(kc),
                    KArg::Ptr(vc),
                    inp(inputs.slot_list),
                    inp(inputs.table_off),
                    inp(inputs.positions),
                    inp(inputs.tiles),
                    inp(inputs.tiles + inputs.n_tiles),
                    KArg::I32(c.heads as i32),
                    KArg::I32(c.kv_heads as i32),
                    KArg::I32(hd as i32),
                    KArg::F32(scale),
                    KArg::Ptr(ws.attn.ptr()),
                ],
            )?;
        }
        if inputs.n_decode == 0 {
            return Ok(());
        }
        let row_list = inputs.decode_rows.map_or(KArg::Ptr(0), inp);
        let n_decode = inputs.n_decode as u32;
        let (kernel, threads) = match (m.decode_mma, self.kv_fp8()) {
            (true, false) => (&k.attention_decode_mma, DA_THREADS),
            (true, true) => (&k.attention_decode_mma_fp8, DA_THREADS),
            (false, false) => (&k.attention, ATTN_THREADS),
            (false, true) => (&k.attention_fp8, ATTN_THREADS),
        };
        dev.launch(
            kernel,
            (self.attention_blocks() as u32, n_decode, splits as u32),
            threads,
            &[
                KArg::Ptr(ws.qkv.ptr()),
                KArg::I32(qkv_w as i32),
                KArg::Ptr(kc),
                KArg::Ptr(vc),
                inp(inputs.slot_list),
                inp(inputs.table_off),
                inp(inputs.positions),
                KArg::I32(c.heads as i32),
                KArg::I32(c.kv_heads as i32),
                KArg::I32(hd as i32),
                KArg::F32(scale),
                KArg::Ptr(ws.attn.ptr()),
                KArg::Ptr(ws.part_o.ptr()),
                KArg::Ptr(ws.part_ml.ptr()),
                row_list,
            ],
        )?;
        if splits == 1 {
            return Ok(());
        }
        dev.launch(
            &k.attn_merge,
            (c.heads as u32, n_decode, 1),
            hd as u32,
            &[
                KArg::Ptr(ws.part_o.ptr()),
                KArg::Ptr(ws.part_ml.ptr()),
                KArg::I32(c.heads as i32),
                KArg::I32(hd as i32),
                KArg::I32(splits as i32),
                KArg::Ptr(ws.attn.ptr()),
                row_list,
            ],
        )
    }

    /// `act = silu(x · gateᵀ) * (x · upᵀ)`: one fused GEMV for decode
    /// batches, else a GEMM into `gate_up` and the SwiGLU kernel. `act`:
    /// rows, or packed for down's int4 GEMM (only the SwiGLU kernel packs).
    fn gate_up_swiglu(
        &self,
        gate_up: &CudaWeight,
        rows: usize,
        input: ProjInput,
        act: LinearInput,
    ) -> Result<()> {
        let m = &*self.model;
        let (dev, c, ws) = (&*m.dev, &m.dims, &self.ws);
        let (d, inter) = (c.hidden, c.intermediate);
        if let Some(m) = self.w4_direct(gate_up, rows) {
            let (x, norm) = self.w4_projection_input(input, rows, m)?;
            return dev.w4_mm(x, rows, m, W4Out::SwiGlu { out: act.rows()? }, norm);
        }
        let fused = gate_up.gemv_weight().filter(|_| dev.gemv_fits(rows, d));
        let (x, norm) = self.projection_input(input, rows, fused.is_some())?;
        if let Some(gate_up) = fused {
            let (nw, eps) = norm.unwrap_or((0, 0.0));
            return dev.launch_gemv(
                GemvFamily::SwiGlu,
                gate_up,
                inter,
                (rows, 2 * inter, d),
                &[
                    KArg::Ptr(x.rows()?),
                    KArg::Ptr(gate_up.ptr()),
                    KArg::Ptr(act.rows()?),
                    KArg::I32(inter as i32),
                    KArg::I32(d as i32),
                    KArg::I32(rows as i32),
                    KArg::Ptr(nw),
                    KArg::F32(eps),
                ],
            );
        }
        self.linear(x, gate_up, None, ws.gate_up.ptr(), rows, 2 * inter, d)?;
        let gate_up = KArg::Ptr(ws.gate_up.ptr());
        match act {
            LinearInput::Rows(out) => dev.launch(
                &dev.kernels.silu_mul,
                (inter.div_ceil(8 * 256) as u32, rows as u32, 1),
                256,
                &[gate_up, KArg::Ptr(out), KArg::I32(inter as i32)],
            ),
            LinearInput::W4Packed => dev.launch(
                &dev.kernels.silu_mul_w4g,
                (cuda::w4_packed_blocks(rows, inter), 1, 1),
                cuda::W4_PACKED_THREADS,
                &[
                    gate_up,
                    KArg::Ptr(self.w4_scratch()?),
                    KArg::I32(rows as i32),
                    KArg::I32(inter as i32),
                ],
            ),
        }
    }

    /// Where the kernel before product `w` of a `rows`-row step writes
    /// its input: rows at `rows_at`, or packed for the int4 GEMM when `w`
    /// runs there (weights without act-order, which gather their rows).
    fn product_input(&self, w: &CudaWeight, rows: usize, rows_at: u64) -> LinearInput {
        let m = &*self.model;
        let packs =
            m.w4_packed_inputs && m.w4_gemm_takes(rows) && w.int4().is_some_and(|q| !q.has_perm());
        if packs {
            LinearInput::W4Packed
        } else {
            LinearInput::Rows(rows_at)
        }
    }

    /// The residual add (of `delta`, if not 0) and norm before product
    /// `w`: into `normed`, or packed for the int4 GEMM (`product_input`).
    fn norm_before(&self, w: &CudaWeight, rows: usize, delta: u64, norm: u64) -> Result<ProjInput> {
        let ws = &self.ws;
        let (dev, c) = (&*self.model.dev, &self.model.dims);
        let normed = self.product_input(w, rows, ws.normed.ptr());
        match normed {
            LinearInput::Rows(out) => {
                self.add_rms_norm(rows as u32, delta, KArg::Ptr(0), norm, out)?
            }
            LinearInput::W4Packed => dev.launch(
                &dev.kernels.add_rms_norm_w4g,
                (cuda::w4_packed_rows(rows) as u32, 1, 1),
                norm_threads(c.hidden),
                &[
                    KArg::Ptr(ws.hidden.ptr()),
                    KArg::Ptr(delta),
                    KArg::Ptr(norm),
                    KArg::Ptr(self.w4_scratch()?),
                    KArg::I32(rows as i32),
                    KArg::I32(c.hidden as i32),
                    KArg::F32(c.rms_norm_eps),
                ],
            )?,
        }
        Ok(ProjInput::Normed(normed))
    }
}

/// Enqueues one forward over the uploaded inputs on the stream (no host
/// synchronization: it may be captured into a graph): the model's layer
/// program over this step's ops.
pub(super) fn enqueue(ctx: &CudaForward, inputs: &Inputs, splits: usize) -> Result<()> {
    let in_projections = ctx.residual_in_projections(inputs.rows);
    let mut ops = CudaLayerOps {
        ctx,
        inputs,
        splits,
        in_projections,
        handoff: in_projections && ctx.norm_handoff(inputs.rows),
    };
    (ctx.model.program)(&mut ops, &ctx.model.weights)
}

/// One step's ops on a GPU: the context, the step's uploaded inputs, and
/// the fused form the step takes.
pub struct CudaLayerOps<'a> {
    ctx: &'a CudaForward,
    inputs: &'a Inputs,
    /// Attention splits of the decode rows.
    splits: usize,
    /// Whether the residual stream runs through the projections
    /// (`CudaForward::residual_in_projections`).
    in_projections: bool,
    /// Whether each norm is handed from the product before it
    /// (`CudaForward::norm_handoff`).
    handoff: bool,
}

impl LayerOps for CudaLayerOps<'_> {
    type Formats = CudaFormats;
    type Normed = ProjInput;

    fn embed(&mut self, w: &CudaWeights) -> Result<()> {
        let (ctx, inputs) = (self.ctx, self.inputs);
        let dev = &*ctx.model.dev;
        let (ws, k) = (&ctx.ws, &dev.kernels);
        let inp = |o: usize| KArg::Ptr(ws.inputs.at(o));
        let r32 = inputs.rows as u32;
        dev.launch(
            &k.rope_table,
            (r32, 1, 1),
            64,
            &[
                inp(inputs.positions),
                KArg::Ptr(w.rope.ptr()),
                KArg::I32((ctx.model.dims.head_dim / 2) as i32),
                KArg::Ptr(ws.rope_cs.ptr()),
            ],
        )?;
        dev.launch(
            &k.embed,
            (r32, 1, 1),
            256,
            &[
                KArg::Ptr(w.embed.ptr()),
                inp(inputs.tokens),
                KArg::Ptr(ws.hidden.ptr()),
                KArg::I32(ctx.model.dims.hidden as i32),
                KArg::I32(ctx.model.dims.vocab as i32),
            ],
        )?;
        if self.handoff {
            // The sums the first handoff (layer 0's o) adds into.
            // SAFETY: the workspace buffer outlives the step.
            unsafe { dev.zero(ws.norm_sums.ptr(), ws.norm_sums.bytes()) }?;
        }
        Ok(())
    }

    fn norm(
        &mut self,
        index: usize,
        weight: &DeviceBuffer<u16>,
        reader: &CudaWeight,
    ) -> Result<ProjInput> {
        let ctx = self.ctx;
        if self.in_projections {
            // Norm 0 (layer 0's input norm) follows the embedding: normed
            // by QKV itself; the others may come from the product before.
            return Ok(if self.handoff && index > 0 {
                ProjInput::Handoff {
                    sums: ctx.norm_sums(index),
                    clear: ctx.norm_sums(index + 1),
                }
            } else {
                ProjInput::Residual(weight.ptr())
            });
        }
        // The residual add of the product before (none before norm 0),
        // fused with this norm.
        let delta = if index == 0 { 0 } else { ctx.ws.delta.ptr() };
        ctx.norm_before(reader, self.inputs.rows, delta, weight.ptr())
    }

    fn qkv_rope_kv_write(
        &mut self,
        layer: usize,
        x: ProjInput,
        w: &LayerWeights<CudaFormats>,
    ) -> Result<()> {
        let kv = self.ctx.layer_kv(layer);
        self.ctx.qkv_rope_kv_write(w, self.inputs, kv, x)
    }

    fn attend(&mut self, layer: usize) -> Result<()> {
        let kv = self.ctx.layer_kv(layer);
        self.ctx.attend(self.inputs, kv, self.splits)
    }

    fn add_product(
        &mut self,
        x: Activations,
        w: &CudaWeight,
        bias: Option<&DeviceBuffer<u16>>,
        next_norm: Option<(usize, &DeviceBuffer<u16>)>,
    ) -> Result<()> {
        let ctx = self.ctx;
        let (ws, d) = (&ctx.ws, ctx.model.dims);
        let rows = self.inputs.rows;
        let (input, k) = match x {
            Activations::Attention => (ws.attn.ptr(), d.q_width()),
            Activations::SwiGlu => (ws.act.ptr(), d.intermediate),
        };
        if self.in_projections {
            let handoff = next_norm
                .filter(|_| self.handoff)
                .map(|(i, norm)| W4Handoff {
                    xs: ws.normed.ptr(),
                    next_norm: norm.ptr(),
                    sums: ctx.norm_sums(i),
                });
            return ctx.add_to_residual(input, w, (rows, d.hidden, k), handoff);
        }
        // The output is the next norm's delta (added to the residual there).
        let input = match x {
            Activations::Attention => LinearInput::Rows(input),
            Activations::SwiGlu => ctx.product_input(w, rows, input),
        };
        ctx.linear(input, w, bias, ws.delta.ptr(), rows, d.hidden, k)
    }

    fn gate_up_swiglu(
        &mut self,
        x: ProjInput,
        gate_up: &CudaWeight,
        down: &CudaWeight,
    ) -> Result<()> {
        let (ctx, rows) = (self.ctx, self.inputs.rows);
        let act = if self.in_projections {
            LinearInput::Rows(ctx.ws.act.ptr())
        } else {
            ctx.product_input(down, rows, ctx.ws.act.ptr())
        };
        ctx.gate_up_swiglu(gate_up, rows, x, act)
    }

    fn logits(
        &mut self,
        final_norm: &DeviceBuffer<u16>,
        head: LmHead<'_, CudaFormats>,
    ) -> Result<()> {
        let (ctx, inputs) = (self.ctx, self.inputs);
        let n_out = inputs.n_out;
        if n_out == 0 {
            return Ok(());
        }
        let (dev, ws, d) = (&*ctx.model.dev, &ctx.ws, ctx.model.dims);
        // Last residual add (unless the products did it) and the final
        // norm, for the rows that want logits only.
        ctx.add_rms_norm(
            n_out as u32,
            if self.in_projections {
                0
            } else {
                ws.delta.ptr()
            },
            KArg::Ptr(ws.inputs.at(inputs.logits_rows)),
            final_norm.ptr(),
            ws.head_in.ptr(),
        )?;
        let head = match head {
            LmHead::Own(CudaWeight::Int4(h)) => {
                let y = ws.logits.ptr();
                return dev.w4_mm(ws.head_in.ptr(), n_out, h, W4Out::F32 { y }, W4Norm::None);
            }
            LmHead::Own(CudaWeight::Fp8(h)) => {
                let (x, y, dims) = (
                    ws.head_in.ptr(),
                    ws.logits.ptr(),
                    (n_out, d.vocab, d.hidden),
                );
                if dev.gemv_fits(n_out, d.hidden) {
                    return dev.gemv(x, GemvWeight::Fp8(h), y, dims, GemvOut::F32, None);
                }
                let dense = ctx.w4_scratch()?;
                dev.w8_dequant(h, dense)?;
                return dev.gemm(x, dense, y, n_out, d.vocab, d.hidden, GemmDType::F32);
            }
            LmHead::Own(CudaWeight::Dense(h)) => h,
            LmHead::Tied(embed) => embed,
        };
        dev.gemm(
            ws.head_in.ptr(),
            head.ptr(),
            ws.logits.ptr(),
            n_out,
            d.vocab,
            d.hidden,
            GemmDType::F32,
        )
    }
}
