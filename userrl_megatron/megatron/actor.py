"""The Megatron actor: log-probs, policy-gradient steps, weight export, checkpoints; SPMD across ranks.

Build one `MegatronActor` on every rank after `parallel.initialize`, and call every method on every rank
with the same arguments (each method is collective). Each rank receives the whole `TrainBatch`; the actor
splits it across data-parallel ranks (balancing tokens) and into micro-batches of at most
`megatron.micro_batch_tokens` tokens, and runs them through Megatron's pipeline schedules
(`get_forward_backward_func`: no pipelining, 1F1B, or interleaved 1F1B with virtual stages).

Micro-batches are right-padded rows on CPU / the local layer spec, and packed sequences without padding
(THD) with Transformer Engine. Log-probs are computed from vocab-parallel logits (`logits.py`).

The loss of a step is Σ per-token loss / N, where N is the number of trained tokens (or sequences, for the
seq-mean aggregations) of the *whole* batch, over all micro-batches and data-parallel ranks: each
micro-batch returns its loss sum and its count, Megatron sums the counts across micro-batches and
data-parallel ranks and divides the gradients by the total (`calculate_per_token_loss`).

Mixture-of-experts models add each layer's load-balancing loss (`megatron.moe_aux_loss_coef`), computed per
micro-batch over its real tokens (`padding_mask` keeps padding out). Under `calculate_per_token_loss` Megatron
multiplies a micro-batch's aux loss by its token count T_mb before the division by N, assuming N counts every
token; ours counts trained tokens or rows. The actor scales the aux-loss gradient by N / T (T: the real tokens
of the whole batch), so each step minimises Σ loss / N + coef · Σ_layers Σ_mb (T_mb / T) aux_mb, whatever N,
the micro-batch split and the layout. (Megatron trains MoE with TP > 1 only under sequence parallelism, whose
TP reduction of the router gradient this relies on.)

With `algo.routing_replay: rollout` the MoE routers replay the experts the rollout engine chose for every
position it ran, in both the log-prob and the training forwards (`routing.py`).
"""

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, overload

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.utils import get_model_config

from userrl_megatron.algo.losses import LossInputs, compute_policy_loss
from userrl_megatron.config.loader import ConfigError
from userrl_megatron.config.schema import AlgoConfig, MegatronConfig, ModelConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.convert.assembly import TensorPlan
from userrl_megatron.convert.hf_io import HFWeights
from userrl_megatron.convert.rules import Converter
from userrl_megatron.megatron import checkpoint, cpu, parallel, routing
from userrl_megatron.megatron import optimizer as optim
from userrl_megatron.megatron.checkpoint_writer import CheckpointWriter
from userrl_megatron.megatron.export import export_hf, export_hf_dir, export_plans
from userrl_megatron.megatron.logits import vocab_parallel_logprobs
from userrl_megatron.megatron.model import (
    DTYPES,
    HFSource,
    aux_loss_coef,
    build_chunks,
    load_full_weights,
    use_transformer_engine,
)
from userrl_megatron.megatron.offload import GRADS, STATE, WEIGHTS, Parking, actor_storages
from userrl_megatron.megatron.packing import (
    ModelInput,
    balance,
    packed_input,
    padded_input,
    rows_tensor,
    split_micro_batches,
    to_rows,
    trained_positions,
)
from userrl_megatron.model_store import resolve_model
from userrl_megatron.types import TrainBatch

log = logging.getLogger(__name__)

SEQUENCE_AGGREGATIONS = ("seq-mean-token-sum", "seq-mean-token-mean")


def loss_count(loss_agg: str, rows: int, tokens: float, cp_rank: int) -> float:
    """A micro-batch's share of the loss normaliser N, which Megatron sums over the data- and context-parallel
    ranks: its trained tokens, or for the seq-mean aggregations its rows, counted on CP rank 0 only (every CP rank
    holds a slice of the same rows; counting them on each would shrink the gradients by the CP size)."""
    if loss_agg in SEQUENCE_AGGREGATIONS:
        return float(rows) if cp_rank == 0 else 0.0
    return tokens


@dataclass
class MicroBatch:
    """Episodes `rows` of the batch, as model input plus (for training) their per-token loss inputs."""

    rows: list[int]
    width: int  # longest episode: the width of the per-token row tensors
    input: ModelInput
    loss: dict[str, torch.Tensor] = field(default_factory=dict)  # [len(rows), width] row tensors
    replay_target: routing.RoutingTarget | None = None  # the engine's experts (algo.routing_replay: rollout)
    head_index: torch.Tensor | None = None  # set: the output layer runs at these positions only (trained_positions)
    scored_input: ModelInput | None = None  # the positions the logits cover: `input`, or those of head_index

    @property
    def targets(self) -> ModelInput:
        """Labels and positions of the logits the model returns for this micro-batch."""
        return self.input if self.scored_input is None else self.scored_input


class MegatronActor:
    """The policy model under Megatron: see the module docstring."""

    def __init__(
        self, model: ModelConfig, megatron: MegatronConfig, algo: AlgoConfig, seed: int, load_weights: bool = True
    ) -> None:
        cpu.enter_mode()
        self.cfg, self.algo = megatron, algo
        self.layout = parallel.current_layout()
        self.device = parallel.device()
        self.checkpoint_writer = CheckpointWriter(self.device)
        self.hf_dir = resolve_model(model.path)
        self.arch = Architecture.from_hf_dir(self.hf_dir)
        parallel.check_model_layout(megatron, self.arch)
        self.dtype = DTYPES[model.dtype]
        model_parallel_cuda_manual_seed(seed)
        use_te = use_transformer_engine(megatron.transformer_impl)
        self.packed = use_te  # THD packing needs Transformer Engine attention
        if self.layout.cp > 1 and not use_te:
            raise ConfigError("megatron.context_parallel_size > 1 needs the Transformer Engine layer spec")
        self.converter = Converter(self.arch, te_layout=use_te)
        self._check_routing_replay()
        chunks = build_chunks(self.arch, megatron, self.dtype, use_te, initialize=not load_weights)
        self.replay = routing.install(chunks) if algo.routing_replay == "rollout" else []
        if load_weights:
            source = HFSource(HFWeights(self.hf_dir), self.converter)
            load_full_weights(chunks, source, self.converter, self.layout.tp_rank, self.layout.tp)
        self.chunks = optim.wrap_ddp(chunks, megatron)
        self.optimizer = optim.build_optimizer(self.chunks, megatron, self.dtype)
        self.scheduler = optim.build_scheduler(self.optimizer, megatron)
        config = get_model_config(self.chunks[0])
        config.finalize_model_grads_func = finalize_model_grads
        if megatron.overlap_grad_reduce:  # only the last micro-batch's backward launches the bucket reductions
            config.no_sync_func = [c.no_sync for c in self.chunks]
            config.grad_sync_func = [c.start_grad_sync for c in self.chunks]
            if len(self.chunks) == 1:
                config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
        config.grad_scale_func = self.optimizer.scale_loss
        self.aux_loss_scale = 1.0  # N / T of the step being trained (see the module docstring)
        self.micro_batches_total = 1  # micro-batches of the step over all data-parallel ranks
        if self.arch.is_moe:
            config.moe_grad_scale_func = lambda: self.aux_loss_scale
        self.steps = 0  # optimizer steps taken
        self.parking = Parking()  # what `offload` moved to host memory

    # ---- log-probs ----------------------------------------------------------------------------------

    @overload
    def compute_logprobs(
        self, batch: TrainBatch, with_entropy: Literal[False] = False, trained_only: bool = False
    ) -> list[list[float]]: ...

    @overload
    def compute_logprobs(
        self, batch: TrainBatch, with_entropy: Literal[True], trained_only: bool = False
    ) -> tuple[list[list[float]], list[list[float]]]: ...

    def compute_logprobs(
        self, batch: TrainBatch, with_entropy: bool = False, trained_only: bool = False
    ) -> list[list[float]] | tuple[list[list[float]], list[list[float]]]:
        """Per-token log-probs of every episode (position 0 is 0.0: token t is scored given tokens < t),
        identical on every rank. With `with_entropy`, returns (log-probs, entropies) aligned the same way.
        With `trained_only`, only the tokens `batch.loss_mask` trains are scored (the rest are 0.0), which skips
        the output layer and the softmax everywhere else: what the old and reference log-probs need."""
        cpu.enter_mode()
        self.parking.require("a log-prob pass")
        self._check_tokens(batch)
        for chunk in self.chunks:
            chunk.eval()
        micro_batches = self._plan(batch, train=False, trained_only=trained_only)
        with torch.no_grad():
            outputs = self._run(micro_batches, partial(self._score_forward, with_entropy=with_entropy), True)
        keys = ("logprobs", "entropy") if with_entropy else ("logprobs",)
        results = self._gather_rows(batch, micro_batches, outputs, keys)
        return (results[0], results[1]) if with_entropy else results[0]

    # ---- training -----------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on the whole batch; metrics (prefixed `actor/`) are identical on every rank."""
        cpu.enter_mode()
        self.parking.require("a training step")
        self._check_tokens(batch)
        self._check_train_batch(batch)
        start = time.perf_counter()
        if batch.num_trained_tokens == 0:
            log.warning("train_step: the batch has no trained tokens; skipping the optimizer step")
            return {"actor/skipped": 1.0, "actor/lr": optim.current_lr(self.optimizer)}
        outputs = self._accumulate_gradients(batch)
        self.scheduler.step(1)
        success, grad_norm, _ = self.optimizer.step()
        if grad_norm is None or self.cfg.grad_clip <= 0:
            grad_norm = self.optimizer.get_grad_norm()
        self.steps += 1
        metrics = self._reduce_metrics(outputs, rollout=batch.rollout_logprobs is not None)
        if self.arch.is_moe and aux_loss_coef(self.arch, self.cfg) > 0:
            metrics.update(self._aux_loss_metric())
        if self.replay:  # positions whose experts came from the engine (the rest: the trainer's own routing)
            replayed = sum(len(r) for r in batch.routed_experts or [])
            metrics["actor/routing_replayed"] = replayed / sum(len(t) for t in batch.token_ids)
        slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)  # the slowest rank's time
        elapsed = float(slowest)
        tokens = sum(len(t) for t in batch.token_ids)
        metrics.update(
            {
                "actor/grad_norm": float(grad_norm),
                "actor/lr": optim.current_lr(self.optimizer),
                "actor/update_ok": float(bool(success)),
                "actor/tokens": float(tokens),
                "actor/trained_tokens": float(batch.num_trained_tokens),
                "actor/episodes": float(len(batch)),
                "actor/step_time_s": elapsed,
                "actor/tokens_per_s": tokens / elapsed,
                "actor/steps": float(self.steps),
            }
        )
        return metrics

    def _accumulate_gradients(self, batch: TrainBatch) -> list[dict]:
        """Zero the gradients, then forward and backward every micro-batch (gradients reduced, not applied)."""
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro_batches = self._plan(batch, train=True, trained_only=True)
        if self.arch.is_moe:
            self._set_aux_loss_scale(batch, len(micro_batches))
        return self._run(micro_batches, self._score_train, forward_only=False)

    def _set_aux_loss_scale(self, batch: TrainBatch, micro_batches: int) -> None:
        """Scale the MoE aux-loss gradient by N / T (see the module docstring); count the micro-batches
        of all data-parallel ranks for the logged aux loss."""
        count = torch.tensor([float(micro_batches)], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(count, group=parallel_state.get_data_parallel_group())
        self.micro_batches_total = int(count.item())
        normaliser = len(batch) if self.algo.loss_agg in SEQUENCE_AGGREGATIONS else batch.num_trained_tokens
        self.aux_loss_scale = normaliser / sum(len(t) for t in batch.token_ids)

    def _aux_loss_metric(self) -> dict[str, float]:
        """`actor/moe_aux_loss`: Σ over layers of the load-balancing loss (without its coefficient), averaged
        over the step's micro-batches (unweighted, as Megatron logs it); read from (and then clearing) Megatron's
        MoE metrics tracker."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if entry is not None:
            total += entry["values"].double().sum()
        torch.distributed.all_reduce(total)  # each layer is recorded on every TP and CP rank of its stage
        clear_aux_losses_tracker()
        if entry is None and float(total) == 0.0:
            return {}
        return {"actor/moe_aux_loss": float(total) / (self.layout.tp * self.layout.cp * self.micro_batches_total)}

    # ---- weights ------------------------------------------------------------------------------------

    def export_hf_weights(self, everywhere: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) for this rank's pipeline stage, on the stage's source rank
        (tp_rank 0, dp_rank 0, cp_rank 0) only, or with `everywhere` on every rank of the stage (every rank of
        the stage must pass the same); nothing elsewhere.

        Collective inside each stage's tensor-parallel group (shards are gathered to tp_rank 0, or
        all-gathered) and, for MoE experts, its expert-parallel group: every rank must exhaust the iterator.
        Vocabulary padding is removed; a tied LM head is not yielded.
        """
        cpu.enter_mode()
        self.parking.require("a weight export")
        yield from export_hf(self._modules(), self.converter, self.layout, everywhere=everywhere)

    def export_hf_plans(self, everywhere: bool = False) -> Iterator[tuple[str, TensorPlan]]:
        """`export_hf_weights` as plans (`export.export_plans`), for weight sync to fill straight into its
        buckets: each must be consumed before the next is asked for. Collective in the same way."""
        cpu.enter_mode()
        self.parking.require("a weight export")
        yield from export_plans(self._modules(), self.converter, self.layout, everywhere=everywhere)

    def tp_group_ranks(self) -> tuple[Any, list[int]]:
        """This rank's tensor-parallel group and its members' global ranks (in group order)."""
        group = parallel_state.get_tensor_model_parallel_group()
        return group, torch.distributed.get_process_group_ranks(group)

    def export_hf_dir(self, out_dir: str, max_shard_bytes: int = 2 * 1024**3) -> int:
        """Write the model as an HF directory (safetensors, config, tokenizer): each pipeline stage writes its
        own shards, no rank holds the whole model (`export.export_hf_dir`); returns the most bytes this rank held
        at once. Collective."""
        cpu.enter_mode()
        self.parking.require("an HF export")
        return export_hf_dir(self._modules(), self.converter, self.layout, out_dir, self.hf_dir, None, max_shard_bytes)

    def _modules(self) -> list[torch.nn.Module]:
        return [c.module for c in self.chunks]

    # ---- state --------------------------------------------------------------------------------------

    def save(
        self,
        path: str,
        extra_state: dict[str, Any] | None = None,
        keep_last: int | None = None,
        with_optimizer: bool = True,
        optimizer_format: str = "dp_reshardable",
        background: bool = False,
    ) -> None:
        """Write a distributed checkpoint to `path` (collective); see `checkpoint.save`. In the `background`,
        it returns once the tensors are copied to host memory; `finish_save` commits it."""
        cpu.enter_mode()
        self.parking.require("a checkpoint save" if with_optimizer else "a model-only checkpoint save")
        checkpoint.save(self, path, extra_state or {}, keep_last, with_optimizer, optimizer_format, background)

    def finish_save(self, wait: bool) -> bool:
        """Commit a background save whose files every rank has written (all of it if `wait`); True when no
        save is left pending. Collective."""
        cpu.enter_mode()
        if wait:
            self.checkpoint_writer.wait()
            return True
        return self.checkpoint_writer.poll()

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]:
        """Restore from a checkpoint directory (or a folder with a `latest` pointer); returns extra_state."""
        cpu.enter_mode()
        self.parking.require("a checkpoint load")
        self.checkpoint_writer.wait()
        return checkpoint.load(self, path, with_optimizer)

    def load_weights(self, path: str) -> None:
        """Load only the model weights of a checkpoint (an SFT run's, as the start of RL): the optimizer state,
        LR schedule and step count stay as they are (fresh); the fp32 master weights follow the loaded ones."""
        cpu.enter_mode()
        self.parking.require("a checkpoint load")
        checkpoint.load_model(path, self._modules(), self.arch, self.layout.tp)
        self.optimizer.reload_model_params()

    def offload(self, weights: bool = True) -> None:
        """Move optimizer state and gradients, and with `weights` the parameters, to host memory and free their
        device storage (`offload.py`; on CPU too). Offloading what is already offloaded does nothing."""
        self.parking.offload(actor_storages(self.chunks, self.optimizer, weights))

    def onload(self, weights_only: bool = False) -> None:
        """Bring everything back before the next compute_logprobs / train_step / save / export (`weights_only`:
        the weights alone, e.g. to push them to an engine restarted while the rest stays offloaded)."""
        self.parking.onload([WEIGHTS] if weights_only else [WEIGHTS, STATE, GRADS])

    def offloaded(self) -> list[str]:
        """What is offloaded now (`offload.WEIGHTS`, `STATE`, `GRADS`)."""
        return sorted(self.parking.kinds)

    # ---- internals ----------------------------------------------------------------------------------

    def _check_routing_replay(self) -> None:
        if self.algo.routing_replay == "none":
            return
        if not self.arch.is_moe:
            raise ConfigError(
                f"algo.routing_replay = {self.algo.routing_replay} needs a mixture-of-experts model; "
                f"{self.arch.family} is dense (set it to none)"
            )
        if self.cfg.recompute != "none" and self.layout.pp > 1:
            # 1F1B runs several forwards before their backwards; a recomputed forward would see a later target
            raise ConfigError("algo.routing_replay = rollout does not support megatron.recompute with pipeline stages")

    def _check_tokens(self, batch: TrainBatch) -> None:
        if len(batch) == 0:
            raise ValueError("TrainBatch is empty")
        for i, ids in enumerate(batch.token_ids):
            if not ids:
                raise ValueError(f"TrainBatch.token_ids[{i}] is empty")
            if min(ids) < 0 or max(ids) >= self.arch.vocab_size:
                raise ValueError(
                    f"TrainBatch.token_ids[{i}] holds ids outside [0, {self.arch.vocab_size}): "
                    f"min {min(ids)}, max {max(ids)}"
                )

    def _check_train_batch(self, batch: TrainBatch) -> None:
        fields: dict[str, Sequence[Sequence[float]]] = {"loss_mask": batch.loss_mask, "advantages": batch.advantages}
        fields.update(
            {
                name: value
                for name, value in (
                    ("old_logprobs", batch.old_logprobs),
                    ("ref_logprobs", batch.ref_logprobs),
                    ("rollout_logprobs", batch.rollout_logprobs),
                )
                if value is not None
            }
        )
        for name, lists in fields.items():
            if len(lists) != len(batch):
                raise ValueError(f"TrainBatch.{name} has {len(lists)} episodes, token_ids has {len(batch)}")
            for i, (values, ids) in enumerate(zip(lists, batch.token_ids, strict=True)):
                if len(values) != len(ids):
                    raise ValueError(f"TrainBatch.{name}[{i}] has {len(values)} values for {len(ids)} tokens")
        for i, mask in enumerate(batch.loss_mask):
            if any(m not in (0, 1) for m in mask):
                raise ValueError(f"TrainBatch.loss_mask[{i}] must hold only 0 and 1")
            if mask[0]:
                raise ValueError(f"TrainBatch.loss_mask[{i}][0] is 1: the first token has no context to be scored")
        if self.algo.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError("algo.kl_coef > 0 needs TrainBatch.ref_logprobs")
        if self.algo.loss_agg == "seq-mean-token-mean" and self.layout.cp > 1:
            raise ValueError("algo.loss_agg = seq-mean-token-mean is not supported with context parallelism")

    def _plan(self, batch: TrainBatch, train: bool, trained_only: bool) -> list[MicroBatch]:
        """This rank's micro-batches (same on every rank of its pipeline), with dummies where needed."""
        lay = self.layout
        lengths = [len(t) for t in batch.token_ids]
        align = self._align()
        shares = balance(lengths, lay.dp)
        groups = self._split(shares[lay.dp_rank], lengths, align)
        # An empty share still runs one (empty) micro-batch, so every rank joins the gradient reduction;
        # interleaved schedules need a multiple of PP micro-batches. Expert-parallel ranks exchange tokens in
        # every MoE layer, so every data-parallel rank runs as many micro-batches as the busiest one (the
        # one-token dummies count in the aux loss, weighted by their single token).
        count = max(len(groups), 1)
        if lay.ep > 1:
            count = max(count, *(len(self._split(other, lengths, align)) for other in shares))
        if lay.vpp > 1:
            count = -(-count // lay.pp) * lay.pp
        groups += [[] for _ in range(count - len(groups))]
        return [self._micro_batch(batch, rows, train, trained_only, align) for rows in groups]

    def _split(self, share: list[int], lengths: list[int], align: int) -> list[list[int]]:
        return split_micro_batches(share, lengths, self.cfg.micro_batch_tokens, self.packed, align) if share else []

    def _align(self) -> int:
        lay = self.layout
        if lay.cp > 1:
            return 2 * lay.cp * lay.tp
        return lay.tp if self.cfg.sequence_parallel else 1

    def _micro_batch(
        self, batch: TrainBatch, rows: list[int], train: bool, trained_only: bool, align: int
    ) -> MicroBatch:
        seqs = [batch.token_ids[r] for r in rows] or [[0]]  # an empty micro-batch: one token, nothing scored
        if self.packed:
            model_input = packed_input(seqs, align, self.layout.cp, self.layout.cp_rank)
        else:
            model_input = padded_input(seqs, align)
        width = max(len(s) for s in seqs)
        mb = MicroBatch(rows=rows, width=width, input=model_input.to(self.device))
        # Under sequence parallelism each TP rank holds a slice of the positions, gathered inside the output
        # layer: the full output layer runs there.
        if trained_only and rows and not self.cfg.sequence_parallel:
            picked = trained_positions(model_input, rows_tensor([batch.loss_mask[r] for r in rows], width))
            if picked is not None:
                mb.head_index, mb.scored_input = picked[0].to(self.device), picked[1].to(self.device)
        if self.replay and batch.routed_experts is not None:
            lay = self.layout
            mb.replay_target = routing.routing_target(
                model_input,
                [batch.routed_experts[r] for r in rows],
                self.arch.num_layers,
                self.arch.moe_top_k,
                lay.tp,
                lay.tp_rank,
                self.cfg.sequence_parallel,
            )
        if train:
            fields: dict[str, Sequence[Sequence[float]]] = {"mask": batch.loss_mask, "advantages": batch.advantages}
            for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
                if getattr(batch, name) is not None:
                    fields[name] = getattr(batch, name)
            mb.loss = {k: rows_tensor([v[r] for r in rows], width).to(self.device) for k, v in fields.items()}
        return mb

    def _run(self, micro_batches: list[MicroBatch], score: Callable[..., tuple], forward_only: bool) -> list[dict]:
        """Run the pipeline schedule, `score` being the loss-function hook; returns its third output for each
        micro-batch on the last stage, [] elsewhere."""
        iterators = [iter(micro_batches) for _ in self.chunks]
        forward_backward = get_forward_backward_func()
        try:
            return forward_backward(
                forward_step_func=partial(self._forward_step, score=score),
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.chunks,
                num_microbatches=len(micro_batches),
                seq_length=max(mb.input.tokens.shape[1] for mb in micro_batches),
                micro_batch_size=max(mb.input.tokens.shape[0] for mb in micro_batches),
                forward_only=forward_only,
            )
        finally:
            routing.set_target(self.replay, None)

    def _forward_step(
        self, data_iterator: Iterator[MicroBatch], model: torch.nn.Module, *, score: Callable[..., tuple]
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple]]:
        """Megatron's forward-step hook: run one micro-batch; the returned function scores its output."""
        mb = next(data_iterator)
        inp = mb.input
        packed = None
        if inp.cu_seqlens is not None:
            cu = inp.cu_seqlens
            packed = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                cu_seqlens_q_padded=cu,
                cu_seqlens_kv_padded=cu,
                max_seqlen_q=inp.max_seqlen,
                max_seqlen_kv=inp.max_seqlen,
            )
        extra: dict[str, Any] = {"padding_mask": inp.row < 0} if self.arch.is_moe else {}  # True = padding (routing)
        if mb.head_index is not None:
            extra |= {"output_processor": _logits_at, "output_processor_context": mb.head_index}
        routing.set_target(self.replay, mb.replay_target)
        output = model(inp.tokens, inp.position_ids, None, packed_seq_params=packed, **extra)
        return output, partial(score, mb)

    def _score_forward(self, mb: MicroBatch, logits: torch.Tensor, with_entropy: bool) -> tuple:
        """Loss-function hook of `compute_logprobs`: per-token log-probs (and entropies) as row tensors."""
        targets = mb.targets
        logprobs, entropy = vocab_parallel_logprobs(logits, targets.labels, self.arch.vocab_size, with_entropy)
        out = {"logprobs": to_rows(logprobs, targets, len(mb.rows), mb.width)}
        if entropy is not None:
            out["entropy"] = to_rows(entropy, targets, len(mb.rows), mb.width)
        return logits.new_zeros(()), torch.ones((), dtype=torch.int, device=logits.device), out

    def _score_train(self, mb: MicroBatch, logits: torch.Tensor) -> tuple:
        """Loss-function hook of `train_step`: (loss sum, its count, metric sums) of one micro-batch."""
        targets = mb.targets
        logprobs, entropy = vocab_parallel_logprobs(
            logits, targets.labels, self.arch.vocab_size, with_entropy=True, entropy_grad=self.algo.entropy_coef > 0
        )
        assert entropy is not None  # asked for with with_entropy=True
        rows, width = len(mb.rows), mb.width
        current = to_rows(logprobs, targets, rows, width)
        old = mb.loss.get("old_logprobs")
        inputs = LossInputs(
            logprobs=current,
            old_logprobs=current.detach() if old is None else old,
            advantages=mb.loss["advantages"],
            mask=mb.loss["mask"],
            ref_logprobs=mb.loss.get("ref_logprobs"),
            rollout_logprobs=mb.loss.get("rollout_logprobs"),
            entropy=to_rows(entropy, targets, rows, width),
        )
        result = compute_policy_loss(inputs, self.algo, normalizer=1.0)
        count = loss_count(self.algo.loss_agg, rows, float(result.num_tokens), self.layout.cp_rank)
        device = logits.device
        sums = {**result.token_sums, "actor/loss": result.loss.detach(), "tokens": result.num_tokens}
        sums["count"] = torch.tensor(count, dtype=torch.float32, device=device)
        return result.loss, torch.tensor(round(count), dtype=torch.int, device=device), sums

    def _gather_rows(
        self, batch: TrainBatch, micro_batches: list[MicroBatch], outputs: list[dict], keys: tuple[str, ...]
    ) -> list[list[list[float]]]:
        """Per-episode row outputs of every data-parallel rank, assembled on every rank (one all-reduce)."""
        lengths = [len(t) for t in batch.token_ids]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(len(keys), offsets[-1], dtype=torch.float32, device=self.device)
        if self.layout.is_output_rank:
            for mb, out in zip(micro_batches, outputs, strict=True):
                for j, r in enumerate(mb.rows):
                    for k, key in enumerate(keys):
                        flat[k, offsets[r] : offsets[r + 1]] = out[key][j, : lengths[r]].float()
        torch.distributed.all_reduce(flat)
        flat = flat.cpu()
        return [[flat[k, offsets[r] : offsets[r + 1]].tolist() for r in range(len(lengths))] for k in range(len(keys))]

    def _reduce_metrics(self, outputs: list[dict], rollout: bool) -> dict[str, float]:
        """Sum the micro-batch metric sums over micro-batches and ranks; divide by tokens (or the count)."""
        keys = sorted(self._metric_keys(rollout))
        totals = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        if self.layout.is_output_rank:
            for out in outputs:
                for k, key in enumerate(keys):
                    if key in out:
                        totals[k] += out[key].double()
        torch.distributed.all_reduce(totals)
        sums = dict(zip(keys, totals.tolist(), strict=True))
        tokens, count = max(sums.pop("tokens"), 1.0), max(sums.pop("count"), 1.0)
        metrics = {"actor/loss": sums.pop("actor/loss") / count}
        metrics.update({key: value / tokens for key, value in sums.items()})
        return metrics

    def _metric_keys(self, rollout: bool) -> set[str]:
        """The metric sums `_score_train` returns for this configuration (every rank must agree on them)."""
        one = torch.zeros(1, 1)
        probe = LossInputs(
            logprobs=one,
            old_logprobs=one,
            advantages=one,
            mask=one,
            ref_logprobs=one if self.algo.kl_coef > 0 else None,
            rollout_logprobs=one if rollout else None,
            entropy=one,
        )
        keys = set(compute_policy_loss(probe, self.algo, normalizer=1.0).token_sums)
        return keys | {"actor/loss", "tokens", "count"}


def _logits_at(
    *,
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: torch.Tensor | None,
    runtime_gather_output: bool | None,
    context: torch.Tensor,
    **_: Any,
) -> torch.Tensor:
    """Megatron's `output_processor` hook: the output layer at the positions `context` (indices into the
    [s, b] hidden states flattened) only, as logits [1, k, V / tp]. A step trains a few percent of its tokens
    (the policy's replies, not the prompts and user turns); the LM head and the softmax over the vocabulary
    are skipped everywhere else."""
    picked = hidden_states.flatten(0, 1).index_select(0, context).unsqueeze(1)
    logits, _ = output_layer(picked, weight=output_weight, runtime_gather_output=runtime_gather_output)
    return logits.transpose(0, 1)
