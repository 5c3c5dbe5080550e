"""Attention alone on one packed row: forward + backward time of each kernel, per row shape, against sdpa per document.

    python benchmarks/attention.py --out results/            # one GPU: a 64k-token row, Qwen2.5-1.5B heads
    python benchmarks/attention.py --row-tokens 512 --head-dim 16 --reps 2   # CPU smoke run

Row shapes (each filled up to ``--row-tokens``): ``longtail`` (the e2e benchmark's long-tail lengths, first fit),
``one-document``, ``1k-documents`` and ``128-documents``. Kernels: sdpa once per document (torch's choice of
backend: the reference), the same with new lengths every call (what training sees: cuDNN plans every new length on
the host), sdpa per document restricted to the flash/efficient kernels, torch's varlen_attn with grouped k/v heads
and with k/v repeated to all heads, ``ds_odc_varlen`` through the transformers interface (the kernel training
uses), and flex_attention with a cached document block mask. Host ms: time until the call returned (before the
device finished); a kernel whose host time reaches its device time keeps the GPU waiting. Each kernel's output and
input gradients are checked against sdpa per document (max abs difference).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_odc.training import attention  # noqa: E402
from ds_odc.balancer.lengths import read_lengths  # noqa: E402
from ds_odc.balancer.presets import longtail_from_normals  # noqa: E402


def row_shapes(row_tokens: int, lengths_file: str | None) -> dict[str, list[int]]:
    if lengths_file:
        pool = read_lengths(lengths_file).tolist()
    else:
        g = torch.Generator().manual_seed(0)
        pool = [int(x) for x in longtail_from_normals(torch.randn(64, generator=g).numpy())]
    scale = row_tokens / 65536
    longtail, total = [], 0
    for n in (max(1, round(n * scale)) for n in pool):
        if total + n <= row_tokens:
            longtail.append(n)
            total += n
    return {"longtail": longtail, "one-document": [row_tokens],
            "1k-documents": [max(1, row_tokens // 64)] * 64, "128-documents": [max(1, row_tokens // 512)] * 512}


class Row:
    """q [1, H, T, D] and k/v [1, KV, T, D] leaves of one packed row, with its document boundaries."""

    def __init__(self, lengths, heads, kv_heads, dim, device, dtype):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.lengths = list(lengths)
        tokens = sum(lengths)
        self.q, self.k, self.v = (torch.randn(1, h, tokens, dim, generator=g).to(device, dtype).requires_grad_()
                                  for h in (heads, kv_heads, kv_heads))
        self.cu = F.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0)).to(torch.int32)
        self.grad_out = torch.randn(1, heads, tokens, dim, generator=g).to(device, dtype)

    def run(self, forward) -> tuple[torch.Tensor, ...]:
        """Forward + backward; returns (output, dq, dk, dv)."""
        for t in (self.q, self.k, self.v):
            t.grad = None
        out = forward(self)
        out.backward(self.grad_out)
        return out.detach(), self.q.grad, self.k.grad, self.v.grad


def sdpa_per_document(row: Row, lengths=None) -> torch.Tensor:
    lengths = lengths or row.lengths
    parts = [F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
             for q, k, v in zip(row.q.split(lengths, 2), row.k.split(lengths, 2), row.v.split(lengths, 2))]
    return torch.cat(parts, 2)


def sdpa_fresh_lengths(row: Row) -> torch.Tensor:
    """The same documents with the first boundary moved by one token per call: every call sees new lengths."""
    sdpa_fresh_lengths.calls = getattr(sdpa_fresh_lengths, "calls", 0) + 1
    lengths = list(row.lengths)
    if len(lengths) > 1:
        shift = sdpa_fresh_lengths.calls % max(1, min(lengths[0], lengths[1]) - 1)
        lengths[0] -= shift
        lengths[1] += shift
    return sdpa_per_document(row, lengths)


def sdpa_flash_efficient(row: Row) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return sdpa_per_document(row)


def varlen(row: Row, repeat_kv: bool) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn
    q, k, v = (x[0].transpose(0, 1) for x in (row.q, row.k, row.v))
    if repeat_kv:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    takes_gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters
    extra = {"enable_gqa": True} if takes_gqa and k.shape[1] != q.shape[1] else {}
    m = max(row.lengths)
    return varlen_attn(q, k, v, row.cu, row.cu, m, m, window_size=(-1, 0), **extra).transpose(0, 1)[None]


def ds_odc_varlen(kernel: str, fresh_lengths: bool = False):
    """``ds_odc_varlen`` through the transformers interface under ``kernel`` (the code training runs)."""
    calls = 0
    layer = torch.nn.Module()
    attention.use_kernel(layer, kernel)

    def forward(row: Row) -> torch.Tensor:
        nonlocal calls
        cu, lengths = row.cu, row.lengths
        if fresh_lengths and len(row.lengths) > 1:  # as sdpa_fresh_lengths: new lengths every call
            calls += 1
            lengths = list(row.lengths)
            shift = calls % max(1, min(lengths[0], lengths[1]) - 1)
            lengths[0] -= shift
            lengths[1] += shift
            cu = F.pad(torch.tensor(lengths, device=row.q.device).cumsum(0), (1, 0)).to(torch.int32)
        out, _ = attention.varlen_attention_forward(layer, row.q, row.k, row.v, None, cu_seq_lens_q=cu,
                                                    max_length_q=max(lengths))
        return out.transpose(1, 2)
    return forward


def flex_cached_mask():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention)
    masks = {}

    def forward(row: Row) -> torch.Tensor:
        key = tuple(row.lengths)
        if key not in masks:
            doc = torch.repeat_interleave(torch.arange(len(row.lengths), device=row.q.device),
                                          torch.tensor(row.lengths, device=row.q.device))
            tokens = doc.numel()
            masks[key] = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), 1, 1, tokens,
                                           tokens, device=row.q.device)
        return compiled(row.q, row.k, row.v, block_mask=masks[key], enable_gqa=True)
    return forward


def kernels(cuda: bool) -> dict:
    table = {"sdpa per document": sdpa_per_document, "sdpa per document, new lengths": sdpa_fresh_lengths,
             "ds_odc_varlen (auto)": ds_odc_varlen("auto"),
             "ds_odc_varlen bucketed": ds_odc_varlen("bucketed"),
             "ds_odc_varlen bucketed, new lengths": ds_odc_varlen("bucketed", fresh_lengths=True)}
    if cuda:
        table["ds_odc_varlen varlen"] = ds_odc_varlen("varlen")
        table.update({"sdpa per document, flash/efficient": sdpa_flash_efficient,
                      "varlen_attn, grouped k/v": lambda r: varlen(r, False),
                      "varlen_attn, k/v repeated": lambda r: varlen(r, True),
                      "flex_attention, cached mask": flex_cached_mask()})
    return table


def sweep(args, device, dtype, cuda: bool) -> list[dict]:
    """Where a document's own sdpa call overtakes the shared varlen launch: rows of ``n`` documents of one length
    (up to 64 of them, at most ``--row-tokens`` in all), fwd+bwd time per document under each kernel. ``bucketed``
    is run with ``long_document=1`` (every document its own padded sdpa call, after its bucket is planned)."""
    rows = []
    length = 256
    while length <= args.row_tokens:
        docs = max(1, min(64, args.row_tokens // length))
        row = Row([length] * docs, args.heads, args.kv_heads, args.head_dim, device, dtype)
        times = {}
        for kernel in ("varlen", "bucketed") if cuda else ("sdpa", "bucketed"):
            layer = torch.nn.Module()
            attention.use_kernel(layer, kernel, long_document=1)

            def forward(r, layer=layer):
                out, _ = attention.varlen_attention_forward(layer, r.q, r.k, r.v, None, cu_seq_lens_q=r.cu,
                                                            max_length_q=length)
                return out.transpose(1, 2)
            m = measure(row, forward, args.reps, cuda)
            times[kernel] = m["ms"] / docs
        rows.append({"length": length, "documents": docs, **{f"{k}_ms_per_doc": v for k, v in times.items()}})
        del row
        length *= 2
    return rows


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(row: Row, forward, reps: int, cuda: bool) -> dict:
    result = row.run(forward)  # warm-up (compiles, plans the fixed lengths)
    sync(cuda)
    host = 0.0
    started = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        row.run(forward)
        host += time.perf_counter() - t
    sync(cuda)
    return {"ms": (time.perf_counter() - started) / reps * 1e3, "host_ms": host / reps * 1e3, "result": result}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row-tokens", type=int, default=65536)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--lengths-file", help="document lengths to fill the long-tail row from (default: e2e's)")
    p.add_argument("--shapes", default=None, help="comma list of row shapes (default: all)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sweep", action="store_true",
                   help="also time rows of equal documents, 256 tokens up to --row-tokens: varlen against each "
                        "document in its own padded sdpa call (where use_kernel's long_document belongs)")
    p.add_argument("--out", default=None, help="write attention.json here")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    shapes = row_shapes(args.row_tokens, args.lengths_file)
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    print(f"# attention fwd+bwd, one packed row of {args.row_tokens} tokens, {args.heads} q / {args.kv_heads} kv heads,"
          f" d {args.head_dim}, {dtype}, {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}:"
          f" {' '.join(sys.argv)}", flush=True)
    results = {}
    for shape, lengths in shapes.items():
        row = Row(lengths, args.heads, args.kv_heads, args.head_dim, device, dtype)
        reference = None
        for name, forward in kernels(cuda).items():
            try:
                m = measure(row, forward, args.reps, cuda)
            except Exception as e:  # a kernel this torch or device lacks is reported, not fatal
                results[(shape, name)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
                continue
            got = m.pop("result")
            reference = reference or got
            same_problem = "new lengths" not in name  # those attend over other documents
            m["max_abs_diff"] = (max((a.float() - b.float()).abs().max().item() for a, b in zip(got, reference))
                                 if same_problem else None)
            results[(shape, name)] = m
        del row
        if cuda:
            torch.cuda.empty_cache()
    print(f"\n{'row shape':<16}{'documents':>10}  {'kernel':<36}{'ms':>9}{'host ms':>9}{'vs sdpa/doc':>12}"
          f"{'max diff':>10}")
    for (shape, name), m in results.items():
        docs = len(shapes[shape])
        if "error" in m:
            print(f"{shape:<16}{docs:>10}  {name:<36}  {m['error']}")
            continue
        ref = results[(shape, "sdpa per document")]["ms"]
        diff = "-" if m["max_abs_diff"] is None else f"{m['max_abs_diff']:.1e}"
        print(f"{shape:<16}{docs:>10}  {name:<36}{m['ms']:>9.2f}{m['host_ms']:>9.2f}{m['ms'] / ref:>11.2f}x{diff:>10}")
    swept = sweep(args, device, dtype, cuda) if args.sweep else []
    if swept:
        names = [k for k in swept[0] if k.endswith("_ms_per_doc")]
        print(f"\n{'document tokens':>16}{'documents':>10}" + "".join(f"{n[:-11] + ' ms/doc':>18}" for n in names)
              + f"{'ratio':>8}")
        for r in swept:
            print(f"{r['length']:>16}{r['documents']:>10}" + "".join(f"{r[n]:>18.3f}" for n in names)
                  + f"{r[names[1]] / r[names[0]]:>8.2f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attention.json").write_text(json.dumps(
            {"argv": sys.argv, "torch": torch.__version__, "shapes": shapes, "sweep": swept,
             "results": [{"shape": s, "kernel": k, **m} for (s, k), m in results.items()]}, indent=1))


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
