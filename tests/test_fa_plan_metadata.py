"""The FlashInfer FA routes' plan metadata, checked on the CPU.

With exact host lengths (what vLLM's builder passes) the routes hand FlashInfer the CSR form
with host offsets and device page ids, so its host-side planner never copies lengths back from
the GPU. These tests check that form against an independent loop, against FlashInfer's own
dense-to-CSR derivation and its metadata validation (flashinfer 0.7.2.post1), and that the
length sort permutes lengths, pages and output rows consistently. The kernels themselves run
in tests/gpu (``test_route_matches_reference[...-host]``,
``test_host_lengths_plan_without_device_sync``).
"""

from __future__ import annotations

import random

import pytest
import torch

from trtllm_mla_plugin.ops import UNIT_SCALES, DecodeBatch, DecodeSpec
from trtllm_mla_plugin.ops.routes.flashinfer_mla import FlashInferFA3Route, paged_csr

flashinfer = pytest.importorskip("flashinfer")
if flashinfer.__version__ != "0.7.2.post1":
    pytest.skip(f"read from flashinfer 0.7.2.post1; installed {flashinfer.__version__}",
                allow_module_level=True)
from flashinfer.mla import MLAPlanMetadata  # noqa: E402
from flashinfer.mla._batch_mla._planning import (  # noqa: E402
    _DensePlanMetadata,
    _derive_csr_from_dense,
    _MLAPlanMetadataResolver,
)

PAGE = 64


def random_table(rng: random.Random, lens: list[int], width: int) -> torch.Tensor:
    pool = list(range(sum(-(-n // PAGE) for n in lens) + 50))
    rng.shuffle(pool)
    table = torch.full((len(lens), width), 10_000, dtype=torch.int32)  # poison past the end
    start = 0
    for i, n in enumerate(lens):
        pages = -(-n // PAGE)
        table[i, :pages] = torch.tensor(pool[start:start + pages], dtype=torch.int32)
        start += pages
    return table


def loop_csr(table: torch.Tensor, lens: list[int]) -> tuple[list[int], list[int]]:
    indptr, indices = [0], []
    for row, n in zip(table.tolist(), lens, strict=True):
        pages = -(-n // PAGE)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
    return indptr, indices


@pytest.mark.parametrize("seed", range(6))
def test_paged_csr_matches_a_loop_and_flashinfers_derivation(seed: int) -> None:
    rng = random.Random(seed)
    b = rng.choice([1, 2, 7, 64])
    lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 4000)]) for _ in range(b)]
    width = max(1, max(-(-n // PAGE) for n in lens)) + rng.randint(0, 3)
    table = random_table(rng, lens, width)
    lens_t = torch.tensor(lens, dtype=torch.int32)

    kv_indptr, kv_indices = paged_csr(table, lens_t, PAGE)

    want_indptr, want_indices = loop_csr(table, lens)
    assert kv_indptr.dtype == kv_indices.dtype == torch.int32
    assert kv_indptr.tolist() == want_indptr
    assert kv_indices.tolist() == want_indices
    derived = _derive_csr_from_dense(
        _DensePlanMetadata(torch.arange(b + 1, dtype=torch.int32), table, lens_t, 1),
        page_size=PAGE)
    assert torch.equal(derived.kv_indptr, kv_indptr)
    assert torch.equal(derived.kv_indices, kv_indices)


class RecordingWrapper:
    """Stands in for ``BatchMLAPagedAttentionWrapper``: keeps what ``plan`` was given."""

    def __init__(self, *args, **kwargs) -> None:
        self.plans: list[dict] = []

    def plan(self, **kwargs) -> None:
        self.plans.append(kwargs)


def planned(monkeypatch, batch: DecodeBatch, spec: DecodeSpec, sort: bool):
    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", RecordingWrapper)
    route = FlashInferFA3Route(spec, torch.device("cpu"), max_batch_size=8)
    route.sort_by_length = sort
    route.plan(batch)
    return route, route._wrapper.plans[-1]["metadata"]


def resolved_csr(metadata: MLAPlanMetadata):
    """FlashInfer's own validation and resolution of the metadata to its CSR form."""
    return _MLAPlanMetadataResolver(metadata=metadata, page_size=PAGE,
                                    device=torch.device("cpu")).resolve_csr()


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("sort", [False, True])
def test_host_lengths_give_flashinfer_host_csr(monkeypatch, sort: bool, q_len: int) -> None:
    rng = random.Random(7)
    lens = [300, 5, 4000, 64, 65, 1999]
    table = random_table(rng, lens, 70)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    spec = DecodeSpec(16, 512, 64, PAGE, torch.bfloat16, torch.bfloat16, 0.1, max_q_len=2)
    device_only = DecodeBatch(table, lens_t, max(lens), max_q_len=q_len)
    host = DecodeBatch(table, lens_t, max(lens), max_q_len=q_len, seq_lens_host=lens_t.clone())

    _, dense = planned(monkeypatch, device_only, spec, sort)
    route, csr_form = planned(monkeypatch, host, spec, sort)

    assert dense.block_tables is not None and dense.kv_indptr is None  # device: page table
    assert csr_form.block_tables is None and csr_form.kv_indptr is not None
    csr = resolved_csr(csr_form)
    reference = resolved_csr(dense)
    order = sorted(range(len(lens)), key=lambda i: -lens[i]) if sort else list(range(len(lens)))
    assert csr.kv_len_arr.tolist() == [lens[i] for i in order]
    assert csr.qo_indptr.tolist() == [q_len * i for i in range(len(lens) + 1)]
    assert csr.kv_len_arr.device.type == csr.kv_indptr.device.type == "cpu"
    # Same pages per request as FlashInfer derives from the page table (in the same order).
    assert torch.equal(csr.kv_indptr, reference.kv_indptr)
    assert torch.equal(csr.kv_indices, reference.kv_indices)
    if sort:  # output row r of the sorted run goes back to caller row perm_rows[r]
        rows = route._perm_rows[: len(lens) * q_len].tolist()
        assert rows == [order[r // q_len] * q_len + r % q_len for r in range(len(rows))]


def test_ragged_query_offsets_come_from_the_host(monkeypatch) -> None:
    lens = [100, 3000, 64]
    table = random_table(random.Random(3), lens, 50)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    spec = DecodeSpec(16, 512, 64, PAGE, torch.bfloat16, torch.bfloat16, 0.1, max_q_len=3)
    batch = DecodeBatch(table, lens_t, 3000, cu_seqlens_q=cu, max_q_len=3, num_tokens=6,
                        seq_lens_host=lens_t, cu_seqlens_q_host=cu.clone())
    _, metadata = planned(monkeypatch, batch, spec, sort=True)  # ragged: no reordering
    csr = resolved_csr(metadata)
    assert csr.qo_indptr.tolist() == [0, 2, 3, 6]
    assert csr.kv_len_arr.tolist() == lens
    # Without the host offsets the host lengths alone are not enough: device path.
    no_cu = DecodeBatch(table, lens_t, 3000, cu_seqlens_q=cu, max_q_len=3, num_tokens=6,
                        seq_lens_host=lens_t)
    assert not no_cu.host_lengths


def test_host_lengths_are_validated() -> None:
    from trtllm_mla_plugin.ops.validation import check_batch

    spec = DecodeSpec(16, 512, 64, PAGE, torch.bfloat16, torch.bfloat16, 0.1)
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens_host must be a CPU int32 tensor of shape"):
        check_batch(spec, DecodeBatch(table, lens, 6, seq_lens_host=lens[:1]), 8)


class RunningWrapper(RecordingWrapper):
    """``RecordingWrapper`` whose ``run`` lowers the query as FlashInfer 0.7.2's wrapper does
    for an FA plan (its own contract code: the layout the plan declared is what it accepts,
    FA backends read the split form) and writes each row's latent part plus the sum of its
    rope part as the output, so the rows reaching the kernel can be traced."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.queries: list[tuple[torch.Tensor, torch.Tensor]] = []

    def run(self, *, query, kv_cache, out, **scales) -> torch.Tensor:
        from flashinfer.mla._batch_mla._contracts import _resolve_structural_mla_input

        plan = self.plans[-1]
        q_nope, q_pe = _resolve_structural_mla_input(
            query, desired="split", widths=(plan["head_dim_ckv"], plan["head_dim_kpe"]),
            name="query", accepted=plan.get("query_layout", "packed"),
            expected_dtype=plan["q_data_type"], planned_dtype_name="q_data_type",
            split_leaf_names=("q_nope", "q_pe"))
        self.queries.append((q_nope, q_pe))
        out.copy_(q_nope + q_pe.sum(-1, keepdim=True))
        return out


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("form", ["packed", "vllm-parts"])
def test_fa_routes_take_vllms_query_parts_unjoined(monkeypatch, form: str, sort: bool) -> None:
    """The FA routes plan ``query_layout="split"`` (FlashInfer's FA3 and FA2 backends read
    the split form; a packed plan would refuse vLLM's parts, which are no adjacent views), so
    the decoder hands them the parts unjoined; length-sorted runs gather both parts' rows and
    put the outputs back in the caller's order."""
    from flashinfer.mla._batch_mla._backends.fa2_backend import (
        _BatchMLAPagedAttentionFa2Backend,
    )
    from flashinfer.mla._batch_mla._backends.fa3_backend import (
        _BatchMLAPagedAttentionFa3Backend,
    )

    for backend in (_BatchMLAPagedAttentionFa3Backend, _BatchMLAPagedAttentionFa2Backend):
        assert not backend._plan_capabilities.requires_packed_query
    assert FlashInferFA3Route.takes_split_query
    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", RunningWrapper)
    lens = [300, 5, 4000, 64]
    table = random_table(random.Random(5), lens, 70)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    spec = DecodeSpec(16, 512, 64, PAGE, torch.bfloat16, torch.bfloat16, 0.1, max_q_len=2)
    route = FlashInferFA3Route(spec, torch.device("cpu"), max_batch_size=8)
    route.sort_by_length = sort
    route.plan(DecodeBatch(table, lens_t, max(lens), max_q_len=2, seq_lens_host=lens_t))
    assert route._wrapper.plans[-1]["query_layout"] == "split"

    torch.manual_seed(0)
    query = torch.randn(8, 16, 576).to(torch.bfloat16)
    if form == "packed":
        given = query
    else:  # vLLM's form: latent contiguous, rope a strided view of the projection
        projected = torch.zeros(8, 16, 128 + 64, dtype=torch.bfloat16)
        projected[..., 128:] = query[..., 512:]
        given = (query[..., :512].contiguous(), projected[..., 128:])
    out = torch.full((8, 16, 512), float("nan"), dtype=torch.bfloat16)
    route.run(given, torch.zeros(70, PAGE, 576, dtype=torch.bfloat16), out, UNIT_SCALES)

    want = query[..., :512] + query[..., 512:].sum(-1, keepdim=True)
    assert torch.equal(out, want)
    q_nope, q_pe = route._wrapper.queries[-1]
    if sort:  # the kernel saw the rows longest request first
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        rows = [2 * i + t for i in order for t in range(2)]
        assert torch.equal(q_nope, query[rows, :, :512])
        assert torch.equal(q_pe, query[rows, :, 512:])
    elif form == "vllm-parts":  # unjoined: the caller's tensors themselves
        assert q_nope.data_ptr() == given[0].data_ptr()
        assert q_pe.data_ptr() == given[1].data_ptr()
