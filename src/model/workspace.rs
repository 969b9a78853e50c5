//! Per-step activation buffers of the forward pass. They only grow, so once
//! a session has seen its largest batch, a step allocates nothing.

#[derive(Default)]
pub struct Workspace {
    pub hidden: Vec<f32>,
    pub normed: Vec<f32>,
    pub qkv: Vec<f32>,
    pub attn: Vec<f32>,
    pub proj: Vec<f32>,
    pub gate_up: Vec<f32>,
    pub act: Vec<f32>,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub selected: Vec<f32>,
}

fn grow(buf: &mut Vec<f32>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
}

impl Workspace {
    #[allow(clippy::too_many_arguments)]
    pub fn prepare(
        &mut self,
        rows: usize,
        out_rows: usize,
        d: usize,
        qkv: usize,
        nq: usize,
        inter: usize,
        half: usize,
    ) {
        grow(&mut self.hidden, rows * d);
        grow(&mut self.normed, rows.max(out_rows) * d);
        grow(&mut self.qkv, rows * qkv);
        grow(&mut self.attn, rows * nq);
        grow(&mut self.proj, rows * d);
        grow(&mut self.gate_up, rows * 2 * inter);
        grow(&mut self.act, rows * inter);
        grow(&mut self.cos, rows * half);
        grow(&mut self.sin, rows * half);
        grow(&mut self.selected, out_rows * d);
    }

    /// Bytes currently reserved.
    pub fn bytes(&self) -> usize {
        [
            &self.hidden,
            &self.normed,
            &self.qkv,
            &self.attn,
            &self.proj,
            &self.gate_up,
            &self.act,
            &self.cos,
            &self.sin,
            &self.selected,
        ]
        .iter()
        .map(|b| b.capacity() * 4)
        .sum()
    }
}
