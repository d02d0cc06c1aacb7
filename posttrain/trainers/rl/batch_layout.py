"""Where the tokens of an RL micro-batch sit in one forward pass, and which outputs a loss reads.

A micro-batch `Experience` has right-padded rows (row i: L_i real tokens); column t of a per-token
tensor scores token t+1 from the tokens <= t. Row i is read at the columns t in [a_i, L_i - 2], a_i
being its first action column (a row without actions is read nowhere); nothing else is computed.

Layouts (`build_layout`):
* padded: the rows as they are;
* packed (--ds.packing_samples): every row's real tokens in one row, positions restarting per sample
  (block-diagonal causal attention, `posttrain.models.forward`);
* shared prefix (`shared`): rows whose tokens 0..a_i agree (the samples of one prompt) form a group:
  the prefix x[0..a_i] once, then each member's continuation x[a_i+1 .. L_i-1] with positions
  a_i+1 .., attending the prefix and itself only (a boolean [R, 1, N, N] mask). One group per layout
  row, or every group in one row when also `packed`. The prefix is computed once per group and its
  gradient accumulates from every continuation, so outputs and gradients equal the per-row
  computation up to float rounding. With a prompt of P tokens, n samples and responses of R tokens,
  a group costs P + nR token positions instead of n(P + R). `inputs["token_weights"]` [R, N] says how many
  rows hold each layout token (a prefix token: its group's size; padding: 0), so per-token means over the
  layout (the MoE router loss, which `models.forward` weighs so) equal those over the rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Layout:
    """`inputs` for the model (`models.forward`); read m is experience cell (`rows[m]`, `cols[m]`), computed
    at layout position (`src_row[m]`, `src_col[m]`), and scores token `targets[m]`."""
    inputs: dict
    rows: torch.Tensor
    cols: torch.Tensor
    src_row: torch.Tensor
    src_col: torch.Tensor
    targets: torch.Tensor
    shape: tuple[int, int]  # [b, T-1] of the experience's per-token tensors

    def kept_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layout columns any read needs (sorted, unique) and, per read, its index among them."""
        keep = torch.unique(self.src_col)
        return keep, torch.searchsorted(keep, self.src_col)

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-read values [M] in the experience's per-token layout [b, T-1] (0 where nothing is read)."""
        out = flat.new_zeros(self.shape)
        out[self.rows, self.cols] = flat
        return out


def _reads(exp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: L_i, a_i (first action column) and whether it has any action column."""
    lengths = exp.attention_mask.sum(1).cpu().numpy().astype(np.int64)
    act = (exp.action_mask > 0).cpu().numpy()
    has = act.any(1) if act.shape[1] else np.zeros(len(lengths), dtype=bool)
    first = act.argmax(1) if act.shape[1] else np.zeros(len(lengths), dtype=np.int64)
    return lengths, first, has


def build_layout(exp, packed: bool = False, shared: bool = False) -> Layout:
    lengths, first, has = _reads(exp)
    seq = exp.sequences
    device = seq.device
    b, width = seq.shape
    read_rows, read_cols = [], []
    for i in range(b):
        if has[i]:
            cols = np.arange(first[i], lengths[i] - 1)
            read_rows.append(np.full(len(cols), i))
            read_cols.append(cols)
    rows = np.concatenate(read_rows) if read_rows else np.zeros(0, dtype=np.int64)
    cols = np.concatenate(read_cols) if read_cols else np.zeros(0, dtype=np.int64)
    if shared:
        inputs, src_row, src_col = _shared(exp, lengths, first, has, rows, cols, packed)
    elif packed:
        real = exp.attention_mask.bool()
        positions = exp.attention_mask.long().cumsum(1) - 1
        inputs = {"input_ids": seq[real][None], "position_ids": positions[real][None]}
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        src_row, src_col = np.zeros_like(rows), offsets[rows] + cols
    else:
        inputs, src_row, src_col = exp.model_batch(), rows, cols
    t = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)  # noqa: E731
    rows_t, cols_t = t(rows), t(cols)
    return Layout(inputs=inputs, rows=rows_t, cols=cols_t, src_row=t(src_row), src_col=t(src_col),
                  targets=seq[rows_t, cols_t + 1], shape=(b, width - 1))


def _shared(exp, lengths, first, has, rows, cols, packed):
    """The shared-prefix layout (module doc): model inputs (with the token weights), each read's source
    position."""
    seq_np = exp.sequences.cpu().numpy()
    prefix = np.where(has, first + 1, lengths)  # a row without reads is all prefix (a group of its own)
    groups: dict[bytes, list[int]] = {}
    for i in range(len(lengths)):
        key = seq_np[i, :prefix[i]].tobytes() if has[i] else b"row%d" % i
        groups.setdefault(key, []).append(i)
    # per layout row (one per group, or one in all when packed)
    ids, pos, branch, doc, count = [], [], [], [], []
    where_row = np.zeros(len(lengths), dtype=np.int64)  # row i's layout row, start of its prefix and own part
    where_prefix = np.zeros(len(lengths), dtype=np.int64)
    where_own = np.zeros(len(lengths), dtype=np.int64)
    for g, members in enumerate(groups.values()):
        if not ids or not packed:
            ids.append([]), pos.append([]), branch.append([]), doc.append([]), count.append([])
        r, s, lead = len(ids) - 1, int(prefix[members[0]]), members[0]
        start = len(ids[r])
        ids[r] += seq_np[lead, :s].tolist()
        pos[r] += list(range(s))
        branch[r] += [0] * s
        count[r] += [len(members)] * s
        for j, i in enumerate(members, start=1):
            where_row[i], where_prefix[i], where_own[i] = r, start, len(ids[r]) - s
            ids[r] += seq_np[i, s:lengths[i]].tolist()
            pos[r] += list(range(s, int(lengths[i])))
            branch[r] += [j] * int(lengths[i] - s)
            count[r] += [1] * int(lengths[i] - s)
        doc[r] += [g] * (len(ids[r]) - start)
    n = max(len(x) for x in ids)
    pad = lambda xs, v: torch.tensor([x + [v] * (n - len(x)) for x in xs], dtype=torch.long)  # noqa: E731
    real = pad([[1] * len(x) for x in ids], 0).bool()
    br, dc = pad(branch, -1), pad(doc, -1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = ((dc[:, :, None] == dc[:, None, :]) & causal
            & ((br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None])) & real[:, None, :])
    mask |= torch.eye(n, dtype=torch.bool)  # padding queries attend themselves (finite, never read)
    device = exp.sequences.device
    inputs = {"input_ids": pad(ids, 0).to(device), "position_ids": pad(pos, 0).to(device),
              "attention_mask": mask[:, None].to(device), "token_weights": pad(count, 0).float().to(device)}
    s = prefix[rows]
    src_col = np.where(cols < s, where_prefix[rows] + cols, where_own[rows] + cols)
    return inputs, where_row[rows], src_col
