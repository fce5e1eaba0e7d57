"""The ops layer's entry points: ``MLADecoder`` (plan per step, run per layer) and the
one-shot ``mla_decode``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..log import get_logger
from . import policy
from .platform import Platform, platform_of
from .routes import ROUTES, DecodeRoute
from .spec import UNIT_SCALES, DecodeBatch, DecodeSpec, KVScales
from .validation import check_batch, check_run_inputs, check_spec

logger = get_logger(__name__)


@dataclass(frozen=True)
class RouteChoice:
    """The chosen route and why every better-ranked route was passed over."""

    name: str
    kernel: str
    skipped: tuple[tuple[str, str], ...]

    def explain(self) -> str:
        lines = [f"{self.name}: {self.kernel}"]
        lines += [f"  not {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _first_eligible(
    ranking: tuple[str, ...], spec: DecodeSpec, platform: Platform
) -> RouteChoice:
    skipped: list[tuple[str, str]] = []
    for name in ranking:
        reason = ROUTES[name].unsupported_reason(spec, platform)
        if reason is None:
            return RouteChoice(name, ROUTES[name].kernel, tuple(skipped))
        skipped.append((name, reason))
    raise ValueError(
        "no decode route can serve this configuration: "
        + "; ".join(f"{name}: {reason}" for name, reason in skipped)
    )


def choose_route(
    spec: DecodeSpec,
    platform: Platform,
    forced: str | None = None,
    shape: policy.BatchShape | None = None,
) -> RouteChoice:
    """First route of the policy's ranking that can serve ``spec`` on ``platform``.

    ``shape`` is one step's batch (``None``: the per-spec default ranking). ``forced``
    names one route (tests, benchmarks, ``TRTLLM_MLA_DECODE_ROUTE``); it must be eligible,
    else ``ValueError`` with its reason.
    """
    if forced is not None:
        if forced not in ROUTES:
            raise ValueError(f"unknown decode route {forced!r}; known: {', '.join(ROUTES)}")
        reason = ROUTES[forced].unsupported_reason(spec, platform)
        if reason is not None:
            raise ValueError(f"decode route {forced!r} cannot serve this configuration: {reason}")
        return RouteChoice(forced, ROUTES[forced].kernel, ())
    return _first_eligible(policy.rank(spec, platform, shape), spec, platform)


def route_set(
    spec: DecodeSpec, platform: Platform, cuda_graph: bool = False,
    max_batch_size: int | None = None,
) -> tuple[RouteChoice, ...]:
    """The routes a decoder may pick per batch: the first eligible route of every ranking
    the policy can produce for ``spec`` (with ``cuda_graph``, for batches of up to
    ``max_batch_size`` ranked without lengths), default first, without repeats."""
    found: dict[str, RouteChoice] = {}
    for ranking in policy.rankings(spec, platform, cuda_graph, max_batch_size):
        choice = _first_eligible(ranking, spec, platform)
        found.setdefault(choice.name, choice)
    return tuple(found.values())


def small_prefill_choice(spec: DecodeSpec, platform: Platform) -> RouteChoice | None:
    """The route for decode batches that carry short prefills (``policy.small_prefill_rank``:
    up to ``policy.SMALL_PREFILL_MAX_Q_LEN`` query tokens per request) for ``spec``, or
    ``None`` where none is eligible (an engine then keeps those requests on its prefill
    path). Eligibility is checked on ``small_prefill_spec(spec)``."""
    wide = small_prefill_spec(spec)
    try:
        return _first_eligible(policy.small_prefill_rank(wide, platform), wide, platform)
    except ValueError:  # no route of the ranking serves it (or the ranking is empty)
        return None


def small_prefill_spec(spec: DecodeSpec) -> DecodeSpec:
    """``spec`` widened to the query length of short prefills."""
    return replace(spec, max_q_len=max(spec.max_q_len, policy.SMALL_PREFILL_MAX_Q_LEN))


def engine_query_dtype(
    spec: DecodeSpec, platform: Platform, forced: str | None = None
) -> torch.dtype:
    """The query dtype an engine should hand to a decoder for ``spec``, whose ``q_dtype``
    is the model's.

    FP8 when the cache is FP8 and every route the decoder would hold reads an FP8 query
    anyway (``DecodeRoute.fp8_query``): the engine's own fused concat + quantise (vLLM's,
    with the layer's ``q_scale``) then replaces the route's separate quantisation, as in
    vLLM's own FLASHMLA backend. Otherwise ``spec.q_dtype`` (the query stays in real
    values). Raises ``ValueError`` as ``choose_route`` does when no route serves ``spec``.
    """
    if not spec.fp8_kv:
        return spec.q_dtype
    if forced is not None:
        choices: tuple[RouteChoice, ...] = (choose_route(spec, platform, forced),)
    else:
        choices = route_set(spec, platform)
    if all(ROUTES[c.name].fp8_query for c in choices):
        return torch.float8_e4m3fn
    return spec.q_dtype


#: ``(latent [tokens, heads, Dc], rope [tokens, heads, Dr], out [tokens, heads, Dc + Dr])``:
#: writes both parts of a 16-bit query into ``out`` (e.g. vLLM's ``concat_mla_q``).
QueryJoin = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


def join_query_parts(latent: torch.Tensor, rope: torch.Tensor, out: torch.Tensor) -> None:
    """``out [tokens, heads, Dc + Dr] = [latent | rope]``, one copy per part.

    Two copies ran 1.8x faster than ``torch.cat`` on vLLM's parts (its rope part is a
    strided view; H200, 480 tokens x 128 heads: 85 against 152 us, run 220); vLLM's fused
    ``concat_mla_q``, which the vLLM backend passes as ``MLADecoder(query_join=...)``, ran
    in 40 us.
    """
    dc = latent.shape[-1]
    out[..., :dc].copy_(latent)
    out[..., dc:].copy_(rope)


class MLADecoder:
    """Absorbed-MLA paged decode for one group of layers sharing a ``DecodeSpec``.

    Construct once (allocates the persistent buffers of every route it may use for up to
    ``max_batch_size`` requests), ``plan`` once per step, ``run`` once per layer.
    ``query_join``: how ``run`` joins a query handed over in two parts for routes that read
    it whole (default ``join_query_parts``; an engine passes its fused kernel).

    Route choice: with ``route=None`` the policy (``ops.policy``) may pick a different
    route per step from host-side batch facts (batch size, ``max_seq_len``, ``kv_tokens``);
    the decoder then holds each route of ``route_set`` (for a route that fails to start,
    the next eligible one of its ranking) and ``route_name`` names the set
    (``"flashinfer-fa3+flashmla"``). ``route`` forces one route.

    CUDA graphs: ``run`` may be captured. A captured ``run`` replays correctly after
    ``plan`` is called again with the same batch size (new lengths and block tables) when
    the decoder was built with ``cuda_graph=True``. Such a decoder ranks routes without the
    batch's lengths, so the route of a batch size never changes between capture and replay.
    FlashInfer's FA2/FA3 routes then keep one planned wrapper with fixed metadata buffers
    per batch size (sized on the first plan of that batch size: later block tables of that
    size must not be wider). Other routes keep fixed buffers either way. Build one decoder
    per stream: the routes' buffers are shared by every layer of a step.
    """

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device | str,
        max_batch_size: int,
        route: str | None = None,
        cuda_graph: bool = False,
        query_join: QueryJoin | None = None,
    ) -> None:
        check_spec(spec)
        self.spec = spec
        #: Writes a query's two parts into one tensor for routes that read it whole
        #: (``join_query_parts`` unless the engine brings a fused kernel for it).
        self.query_join: QueryJoin = query_join or join_query_parts
        self.device = torch.device(device)
        self.cuda_graph = cuda_graph
        self.max_batch_size = max_batch_size
        self.platform = platform_of(self.device)
        if route is not None:
            default = choose_route(spec, self.platform, route)
            choices: tuple[RouteChoice, ...] = (default,)
            self.routes: dict[str, DecodeRoute] = {route: self._build(route)}
        else:
            rankings = policy.rankings(spec, self.platform, cuda_graph, max_batch_size)
            default = _first_eligible(rankings[0], spec, self.platform)
            self.routes = {}
            choices = self._build_first_of_each(rankings, default.name)
        if len(choices) == 1:
            self.choice = default
        else:
            self.choice = RouteChoice(
                "+".join(c.name for c in choices),
                " | ".join(c.kernel for c in choices) + " (per batch, ops.policy)",
                default.skipped,
            )
        #: The route of the last ``plan`` (the default one before any plan).
        self.route: DecodeRoute = self.routes[default.name]
        #: Forces length sorting on or off for routes that support it (benchmarks).
        self.sort_override: bool | None = None
        self._batch: DecodeBatch | None = None

    def _build(self, name: str) -> DecodeRoute:
        return ROUTES[name](self.spec, self.device, self.max_batch_size,
                            cuda_graph=self.cuda_graph)

    def _build_first_of_each(self, rankings: tuple[tuple[str, ...], ...],
                             default: str) -> tuple[RouteChoice, ...]:
        """Builds, for every ranking, its first eligible route that starts, into
        ``self.routes``; returns their choices in ranking order. A per-batch alternative
        that cannot start (e.g. an extension that does not compile) is left out with a
        warning and its ranking's next eligible route is built instead, so its batches run
        what they would run without it; the default route failing raises."""
        choices: dict[str, RouteChoice] = {}
        failed: set[str] = set()
        for ranking in rankings:
            while (choice := _first_eligible(tuple(n for n in ranking if n not in failed),
                                             self.spec, self.platform)).name not in self.routes:
                try:
                    self.routes[choice.name] = self._build(choice.name)
                    choices[choice.name] = choice
                except Exception as error:
                    if choice.name == default:
                        raise
                    failed.add(choice.name)
                    logger.warning("decode route %s left out: %s: %s; its batches run the "
                                   "next route of their ranking", choice.name,
                                   type(error).__name__, error)
        return tuple(choices.values())

    def set_device_plan(self, on: bool) -> None:
        """Plan the ``vllm-fa3-mla`` route's steps on the GPU (``on``) or the host, instead
        of as ``policy.vllm_fa3_device_plan`` says (benchmarks); no-op without that route."""
        route = self.routes.get(policy.VLLM_FA3)
        if route is not None:
            route.device_plan_override = on

    @property
    def route_name(self) -> str:
        """The route, or ``"a+b"`` for the set a per-batch decoder chooses from."""
        return self.choice.name

    def batch_shape(self, batch: DecodeBatch) -> policy.BatchShape:
        """What the policy sees of ``batch``: no lengths under ``cuda_graph``; the KV token
        count is read from the device only when the caller gave none and it matters; each
        request's length only from exact host lengths (``seq_lens_host``), where it matters
        (``policy.wants_lengths``)."""
        if self.cuda_graph:
            return policy.BatchShape(batch.batch_size, batch.max_q_len)
        shape = policy.BatchShape(
            batch.batch_size, batch.max_q_len, batch.max_seq_len, batch.kv_tokens
        )
        if policy.wants_kv_tokens(self.spec, shape):
            lens = batch.seq_lens if batch.seq_lens_host is None else batch.seq_lens_host
            kv_tokens = int(lens.sum())  # a device->host copy unless the host has the lengths
            shape = replace(shape, kv_tokens=kv_tokens)
        if batch.seq_lens_host is not None and policy.wants_lengths(self.spec, shape):
            shape = replace(shape, lengths=tuple(batch.seq_lens_host.tolist()))
        return shape

    def plan(self, batch: DecodeBatch) -> None:
        """Take this step's batch (host-side work; call outside CUDA-graph capture)."""
        check_batch(self.spec, batch, self.route.max_batch_size)
        shape = None
        if len(self.routes) > 1:
            shape = self.batch_shape(batch)
            ranking = policy.rank(self.spec, self.platform, shape)
            name = next(n for n in ranking if n in self.routes)
            self.route = self.routes[name]
        if self.route.supports_length_sort:
            sort = self.sort_override
            if sort is None:
                shape = shape or self.batch_shape(batch)
                sort = policy.fa_sort_by_length(self.spec, shape)
            self.route.sort_by_length = sort
        self.route.plan(batch)
        self._batch = batch

    def run(
        self,
        query: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        """Decode one layer.

        Args:
            query: ``[num_tokens, num_heads, Dc + Dr]`` in ``spec.q_dtype``, or its two
                parts ``([num_tokens, num_heads, Dc], [num_tokens, num_heads, Dr])`` as
                vLLM holds them for 16-bit caches: routes that read them apart
                (``DecodeRoute.takes_split_query``) take them as they are; for the others
                ``query_join`` writes them into one new tensor.
            kv_cache: ``[num_blocks, block_size, Dc + Dr]`` in ``spec.kv_dtype``.
            out: optional ``[num_tokens, num_heads, Dc]`` output buffer. Without it,
                routes whose kernel allocates its output (``DecodeRoute.own_output``) hand
                that back without a copy; the others write into a new tensor.
            scales: FP8 scales (ignored by the math when all are 1).

        Returns:
            ``[num_tokens, num_heads, Dc]`` attention output in latent space.
        """
        if self._batch is None:
            raise RuntimeError("MLADecoder.run called before plan()")
        check_run_inputs(self.spec, self._batch, query, kv_cache, out)
        if isinstance(query, tuple) and not self.route.takes_split_query:
            latent, rope = query
            query = latent.new_empty(*latent.shape[:-1], latent.shape[-1] + rope.shape[-1])
            self.query_join(latent, rope, query)
        if out is None and not self.route.own_output:
            rows = query[0] if isinstance(query, tuple) else query
            out = rows.new_empty(
                rows.shape[0], rows.shape[1], self.spec.kv_lora_rank, dtype=self.output_dtype,
            )
        return self.route.run(query, kv_cache, out, scales)

    @property
    def output_dtype(self) -> torch.dtype:
        """Output dtype: the query's, or bf16 when the query is FP8."""
        return torch.bfloat16 if self.spec.q_dtype == torch.float8_e4m3fn else self.spec.q_dtype


def mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    max_seq_len: int,
    cu_seqlens_q: torch.Tensor | None = None,
    max_q_len: int = 1,
    scales: KVScales = UNIT_SCALES,
    out: torch.Tensor | None = None,
    route: str | None = None,
) -> torch.Tensor:
    """One-shot absorbed-MLA paged decode (plans and runs once; engines use ``MLADecoder``).

    Args:
        query: ``[num_tokens, num_heads, kv_lora_rank + rope_dim]``.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``.
        block_table: ``[batch, max_blocks]`` int32.
        seq_lens: ``[batch]`` int32, cached tokens per request including this step's.
        softmax_scale: scale of ``q . k``.
        kv_lora_rank: latent width ``Dc``.
        max_seq_len: host-side ``max(seq_lens)``.
        cu_seqlens_q: ``[batch + 1]`` int32 query offsets for several query tokens per
            request (causal inside each request); ``None`` for ``max_q_len`` rows each.
        max_q_len: largest query length of a request.
        scales: FP8 scales.
        out: optional ``[num_tokens, num_heads, kv_lora_rank]``.
        route: force one route by name.

    Returns:
        ``[num_tokens, num_heads, kv_lora_rank]``.
    """
    spec = DecodeSpec(
        num_heads=query.shape[1],
        kv_lora_rank=kv_lora_rank,
        rope_dim=query.shape[2] - kv_lora_rank,
        block_size=kv_cache.shape[1],
        q_dtype=query.dtype,
        kv_dtype=kv_cache.dtype,
        softmax_scale=softmax_scale,
        max_q_len=max_q_len,
    )
    decoder = MLADecoder(spec, query.device, seq_lens.shape[0], route)
    decoder.plan(
        DecodeBatch(
            block_table=block_table,
            seq_lens=seq_lens,
            max_seq_len=max_seq_len,
            cu_seqlens_q=cu_seqlens_q,
            max_q_len=max_q_len,
            num_tokens=query.shape[0],
        )
    )
    return decoder.run(query, kv_cache, out, scales)
