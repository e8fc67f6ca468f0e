"""One Triton kernel that turns a batch of decoded images into the model's input (crop, antialiased bilinear resize,
flip, normalization, memory layout) in a single launch, where torch takes two or three small launches per image.
The arithmetic is torch's ``F.interpolate(mode="bilinear", antialias=True)``; float32 throughout. On a CPU device
``crop_resize`` calls torch's resize per image; the tests run the kernel in Triton's interpreter."""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading

import torch

from common.errors import UserError

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU-only builds come without Triton; they resize with torch (see crop_resize)
    triton = None

NFIELDS = 14  # a row per image: offset, height, width, top, left, box h/w, out h/w, out top/left, flip, taps y/x
BLOCK = 256  # output pixels per program
_interpreter_lock = threading.Lock()


def _kernel(src, meta, out, size, stride_n, stride_c, stride_h, stride_w, scale0, scale1, scale2, shift0, shift1,
            shift2, NFIELDS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    k = tl.program_id(0)  # the image
    row = meta + k * NFIELDS
    offset, height, width = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    top, left, box_h, box_w = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
    out_h, out_w, out_top, out_left = tl.load(row + 7), tl.load(row + 8), tl.load(row + 9), tl.load(row + 10)
    flip, taps_y, taps_x = tl.load(row + 11), tl.load(row + 12), tl.load(row + 13)

    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # output pixels of this program
    valid = p < size * size
    oi, oj = p // size, p % size
    # as aten's upsample_bilinear2d_aa: scale = in / out; support 1 (bilinear), times the scale when shrinking
    scale_y = box_h.to(tl.float32) / out_h.to(tl.float32)
    scale_x = box_w.to(tl.float32) / out_w.to(tl.float32)
    support_y, support_x = tl.maximum(scale_y, 1.0), tl.maximum(scale_x, 1.0)
    inv_y, inv_x = 1.0 / support_y, 1.0 / support_x
    center_y = scale_y * ((out_top + oi).to(tl.float32) + 0.5)
    center_x = scale_x * ((out_left + oj).to(tl.float32) + 0.5)
    y_min = tl.maximum((center_y - support_y + 0.5).to(tl.int32), 0)  # truncation toward zero, as in C++
    y_end = tl.minimum((center_y + support_y + 0.5).to(tl.int32), box_h.to(tl.int32))
    x_min = tl.maximum((center_x - support_x + 0.5).to(tl.int32), 0)
    x_end = tl.minimum((center_x + support_x + 0.5).to(tl.int32), box_w.to(tl.int32))

    plane = height * width
    zero = tl.full((BLOCK,), 0.0, tl.float32)
    acc0, acc1, acc2, sum_y, sum_x = zero, zero, zero, zero, zero
    # taps_*: the widest window, from the host; narrower ones are masked (while: the interpreter needs it)
    tx = taps_x * 0
    while tx < taps_x:  # the weights of a row, the same for each of its taps_y rows
        x = x_min + tx
        sum_x += tl.where(x < x_end, tl.maximum(1.0 - tl.abs((x.to(tl.float32) - center_x + 0.5) * inv_x), 0.0), 0.0)
        tx += 1
    ty = taps_y * 0
    while ty < taps_y:
        y = y_min + ty
        in_y = valid & (y < y_end)
        w_y = tl.where(in_y, tl.maximum(1.0 - tl.abs((y.to(tl.float32) - center_y + 0.5) * inv_y), 0.0), 0.0)
        sum_y += w_y
        line = src + offset + (top + y).to(tl.int64) * width + left
        r0, r1, r2 = zero, zero, zero
        tx = taps_x * 0
        while tx < taps_x:
            x = x_min + tx
            in_x = x < x_end
            w_x = tl.where(in_x, tl.maximum(1.0 - tl.abs((x.to(tl.float32) - center_x + 0.5) * inv_x), 0.0), 0.0)
            m = in_y & in_x
            r0 += w_x * tl.load(line + x, mask=m, other=0).to(tl.float32)
            r1 += w_x * tl.load(line + plane + x, mask=m, other=0).to(tl.float32)
            r2 += w_x * tl.load(line + 2 * plane + x, mask=m, other=0).to(tl.float32)
            tx += 1
        acc0 += w_y * r0
        acc1 += w_y * r1
        acc2 += w_y * r2
        ty += 1
    norm = 1.0 / tl.where(valid, sum_y * sum_x, 1.0)
    col = tl.where(flip != 0, size - 1 - oj, oj)
    dst = out + k * stride_n + oi * stride_h + col * stride_w
    tl.store(dst, acc0 * norm * scale0 + shift0, mask=valid)
    tl.store(dst + stride_c, acc1 * norm * scale1 + shift1, mask=valid)
    tl.store(dst + 2 * stride_c, acc2 * norm * scale2 + shift2, mask=valid)


@functools.cache
def _compiled(interpret: bool):  # the interpreter runs the kernel on the CPU (tests)
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_kernel) if interpret else triton.jit(_kernel)


def taps(box: int, out: int) -> int:
    """An upper bound on the input pixels one output pixel reads along a side: the window is at most 2 * support + 1."""
    return int(2 * max(box / out, 1.0)) + 2


def crop_resize(images: list[torch.Tensor], geometry: list[tuple], out: torch.Tensor, scale: list[float],
                shift: list[float], kernel: bool | None = None) -> torch.Tensor:  # fmt: skip
    """Fill ``out`` (n, 3, S, S) float32 from ``images`` ((3, H, W) uint8 each). ``geometry[k] = (top, left, box_h,
    box_w, out_h, out_w, out_top, out_left, flip)``: the box is resized to (out_h, out_w), the S x S window at
    (out_top, out_left) kept, flipped if asked, then ``x * scale[c] + shift[c]``. ``kernel``: Triton (default on a
    GPU) or torch's resize per image (default on the CPU)."""
    n, _, size, _ = out.shape
    if not (images[0].is_cuda if kernel is None else kernel):
        shift_t, scale_t = torch.tensor(shift).view(3, 1, 1), torch.tensor(scale).view(3, 1, 1)
        for img, (top, left, h, w, oh, ow, otop, oleft, flip), row in zip(images, geometry, out):
            # F.interpolate(mode="bilinear", antialias=True) minus its Python checks
            x = torch.ops.aten._upsample_bilinear2d_aa(img[None, :, top : top + h, left : left + w].float(), (oh, ow),
                                                       False)[0]  # fmt: skip
            x = x[:, otop : otop + size, oleft : oleft + size]
            row.copy_((x.flip(-1) if flip else x) * scale_t + shift_t)
        return out
    if triton is None:
        raise UserError("--gpu-decode on a GPU needs Triton (pip install triton), which torch's CUDA builds bring")
    offsets = itertools.accumulate((img.numel() for img in images), initial=0)
    src = torch.cat([img.reshape(-1) for img in images])  # one flat buffer
    rows = [(o, img.shape[1], img.shape[2], *g[:8], int(g[8]), taps(g[2], g[4]), taps(g[3], g[5]))
            for o, img, g in zip(offsets, images, geometry)]  # fmt: skip
    meta = torch.tensor(rows, dtype=torch.int64, pin_memory=src.is_cuda).to(src.device, non_blocking=True)
    block = BLOCK if src.is_cuda else triton.next_power_of_2(size * size)  # the interpreter: fewer, wider programs
    grid = (n, triton.cdiv(size * size, block))
    args = (src, meta, out, size, *out.stride(), *scale, *shift)
    with contextlib.nullcontext() if src.is_cuda else _interpreter_lock:
        _compiled(not src.is_cuda)[grid](*args, NFIELDS=NFIELDS, BLOCK=block, num_warps=4)
    return out
