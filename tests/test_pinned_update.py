"""One update, pinned: the parameters after exactly one RL update equal recorded numbers.

Each case builds a ``tiny`` policy (in-process tokenizer, fixed initialisation), runs one
update on a fixed seed and compares, per model, the parameters after it (float64 sum and
sum of squares, the summed absolute and squared change, a few named entries), the
gradient every optimiser step saw (summed absolute value and squares, after clipping) and
the update's loss metrics with the values below (relative tolerance 1e-6). The numbers
were recorded on the code before the large modules were split into smaller ones (issue
32); a change of behaviour anywhere in the update path (rows, minibatches, packing, the
losses and their normalisation, the auxiliary terms, the exchange, the optimiser and its
schedule) moves them. They are CPU fp32 numbers: a change of the numerics underneath
(torch, transformers, another CPU) may move them too; then re-record them on the last
commit that matched, not on the change under test.

Cases:
- ``grpo``: ``GRPOModule.update`` on a hand-built batch (shared prompts, a two-turn
  trajectory with a per-turn advantage, a non-trained turn, a LUFFY peer row, a
  sequence-ratio row, a zero-advantage group), KL to the reference, two shuffled
  minibatches of packed micro-batches, AdamW with warm-up and cosine decay;
- ``grpo_unpacked``: the same without packing or length-aware micro-batches;
- ``vhgpo``: ``VHGPOModule.update`` on a batch carrying relays (bridge, resume and pair
  terms in the last minibatch);
- ``vhgpo_fit``: one ``fit`` step of VH-GPO with ``VerifiedHandoff`` (oracle teacher) on
  the scripted environment: the rescue search attaches the relays the update trains on;
- ``graft``, ``sgt``, ``hacpo``: one ``fit`` step of ``GRAFTModule`` (two tiny models with
  different tokenizers, scripted outcomes) in each mode;
- ``graft_variants``: the same with GRAFT's ablation switches (random count-matched
  selection, pooled advantages, random admission, uniform order, LUFFY peer loss); added
  with the GRAFT split, its numbers recorded on the code before the split as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from scripted_policies import RightFromDepth
from torch.optim.optimizer import register_optimizer_step_pre_hook

from salvage.callbacks.relay import TeacherSpec, VerifiedHandoff
from salvage.core.agent import AgentFormat
from salvage.core.grpo import assign_advantages
from salvage.core.relay import RelayConfig
from salvage.datamodules.agent import AgentDataModule, EnvSpec
from salvage.datamodules.graft import GraftDataModule
from salvage.models import PolicySpec
from salvage.modules.graft import GRAFTModule
from salvage.modules.grpo import GRPOModule
from salvage.modules.vhgpo import VHGPOModule
from salvage.rollout.config import EngineConfig
from salvage.tasks.math import MathData
from salvage.types import Group, RelayData, RolloutBatch, SeqRatio, SeqTarget, Trajectory, Turn

REL = 1e-6
ABS = 1e-8
# the logged float32 losses: one reduction's rounding differs between CPUs (measured on a
# second machine of this kind: up to 2.2e-6 relative, 1.1e-8 absolute on a loss near 0)
METRIC_REL, METRIC_ABS = 1e-5, 1e-7
ENTRIES = (  # (parameter, index): entries the update moves
    ("model.layers.0.self_attn.q_proj.weight", (0, 0)),
    ("model.layers.1.mlp.down_proj.weight", (1, 2)),
    ("model.layers.1.input_layernorm.weight", (3,)),
    ("model.norm.weight", (0,)),
)
METRIC_KEYS = ("loss/", "train/grad_norm", "relay/", "graft/")


# ---------------------------------------------------------------------- measuring
class _Grads:
    """Records, at every optimiser step, the gradient of each parameter group's params."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []

    def __call__(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        ab = sq = 0.0
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.detach().double()
                    ab += float(g.abs().sum())
                    sq += float((g * g).sum())
        self.steps.append((ab, sq))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def _param_stats(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> dict[str, float]:
    s = sq = dabs = dsq = 0.0
    params = dict(model.named_parameters())
    for name, p in params.items():
        x = p.detach().double()
        d = x - before[name]
        s += float(x.sum())
        sq += float((x * x).sum())
        dabs += float(d.abs().sum())
        dsq += float((d * d).sum())
    out = {"sum": s, "sumsq": sq, "delta_abs": dabs, "delta_sq": dsq}
    for name, idx in ENTRIES:
        out[f"{name}{list(idx)}"] = float(params[name].detach()[idx])
    return out


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in values.items():
        bare = k.split("/", 1)[1] if k[:2] in ("a/", "b/") else k
        if bare.startswith(METRIC_KEYS) and "time" not in k:
            out[k] = float(v)
    return out


def _measure(
    run: Callable[[], tuple[dict[str, torch.nn.Module], dict[str, Any]]],
    models: Callable[[], dict[str, torch.nn.Module]],
) -> dict[str, float]:
    """``run()`` -> (models after the update, metrics). The parameters are compared with
    their values when the first optimiser step starts (``models()`` names them then, as
    modules load their models inside ``fit``)."""
    grads = _Grads()
    before: dict[str, dict[str, torch.Tensor]] = {}

    def pre_step(opt: torch.optim.Optimizer, *rest: Any) -> None:
        if not before:
            before.update({name: _snapshot(m) for name, m in models().items()})
        grads(opt, *rest)

    handle = register_optimizer_step_pre_hook(pre_step)
    try:
        trained, values = run()
    finally:
        handle.remove()
    out: dict[str, float] = {}
    for name, m in trained.items():
        for k, v in _param_stats(m, before[name]).items():
            out[f"{name}/param/{k}"] = v
    for i, (ab, sq) in enumerate(grads.steps):
        out[f"grad/{i}/abs"] = ab
        out[f"grad/{i}/sq"] = sq
    out.update({f"metric/{k}": v for k, v in _metrics(values).items()})
    return out


# ---------------------------------------------------------------------- hand-built batches
def _ids(tok: Any, text: str, eos: bool = False) -> list[int]:
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    return ids + [int(tok.eos_token_id)] if eos else ids


def _old(n: int, salt: int) -> list[float]:
    """Behaviour log-probs near the tiny model's (about -6.2), some far enough to clip."""
    return [-6.2 + 0.15 * (((salt * 7 + j * 3) % 5) - 2) for j in range(n)]


def _traj(turns: list[Turn], adv: float, **kw: Any) -> Trajectory:
    return Trajectory(turns=turns, reward=float(adv > 0), success=adv > 0, advantage=adv, **kw)


def _turn(prompt: list[int], resp: list[int], salt: int, **kw: Any) -> Turn:
    return Turn(list(prompt), list(resp), _old(len(resp), salt), **kw)


def _grpo_batch(tok: Any) -> RolloutBatch:
    p0 = _ids(tok, "What is 3 + 4? Let's think step by step.")
    p1 = _ids(tok, "Task: take coin. Observation: You are in room kitchen.")
    p2 = _ids(tok, "Compute 14 * 22 - 22:")
    g0 = Group(
        "g0",
        [
            _traj([_turn(p0, _ids(tok, "3 + 4 = 7. The answer is \\boxed{7}.", True), 1)], 1.0),
            _traj([_turn(p0, _ids(tok, "The answer is \\boxed{8}", True), 2)], -0.5),
            _traj([_turn(p0, _ids(tok, "3 + 4 = 12 so \\boxed{12}."), 3)], -0.5),
        ],
    )
    r1 = _ids(tok, "<action>look</action>")
    obs = _ids(tok, " Observation: a table and a fridge.")
    two_turn = _traj(
        [
            _turn(p1, r1, 4),
            _turn(p1 + r1 + obs, _ids(tok, "<action>take coin</action>", True), 5, advantage=0.3),
        ],
        0.8,
    )
    skipped = _traj(
        [
            _turn(p1, _ids(tok, "<action>go north</action>"), 6, train=False),
            _turn(p1 + obs, _ids(tok, "<action>open door</action>", True), 7),
        ],
        -0.4,
    )
    luffy = _traj(
        [_turn(p1, _ids(tok, "<action>examine table</action>", True), 8)],
        0.6,
        source="peer",
        weight=0.7,
        loss="luffy",
    )
    seq = _traj(
        [_turn(p1, _ids(tok, "<action>inventory</action>", True), 9)],
        -0.2,
        source="peer",
        loss="hacpo",
        seq_ratio=SeqRatio(ref=-6.1, low=0.8, high=1.2),
    )
    g1 = Group("g1", [two_turn, skipped, luffy, seq])
    g2 = Group(
        "g2",
        [
            _traj([_turn(p2, _ids(tok, "\\boxed{286}", True), 10)], 0.0),
            _traj([_turn(p2, _ids(tok, "14 * 22 = 308, 308 - 22 = \\boxed{286}."), 11)], 0.0),
        ],
        zero_signal=True,
    )
    return RolloutBatch(groups=[g0, g1, g2], temperature=0.9)


def _relays(tok: Any) -> list[RelayData]:
    h = _ids(tok, "Admissible actions: [take coin, look around] You are in room kitchen.")
    chosen = SeqTarget(h, _ids(tok, "<action>take coin</action>"), [0, 1, 1, 1, 0])
    rejected = SeqTarget(h, _ids(tok, "<action>look around</action>"), None)
    return [
        RelayData(
            bridge=[
                SeqTarget(_ids(tok, "room with coin"), _ids(tok, "<action>take coin</action>")),
                SeqTarget(_ids(tok, "a kitchen"), _ids(tok, "<action>look around</action>")),
            ],
            resume=[SeqTarget(_ids(tok, "step 3"), _ids(tok, "<action>go east</action>", True))],
            pair=(chosen, rejected),
        ),
        RelayData(
            bridge=[SeqTarget(_ids(tok, "the fridge"), _ids(tok, "<action>open door</action>"))],
            resume=[],
            pair=None,
        ),
    ]


def _update(module: GRPOModule, batch_of: Callable[[Any], RolloutBatch]) -> Callable[[], Any]:
    def run() -> tuple[dict[str, torch.nn.Module], dict[str, Any]]:
        module.build()
        module.total_steps_hint = 5
        conf = module.configure_optimizers()
        opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
        values = module.update(batch_of(module.tokenizer), opt, sched, 0)
        return {"policy": module.live_policy}, values

    return run


def case_grpo(tmp_path: Path, lr: float = 1e-3, **kw: Any) -> dict[str, float]:
    torch.manual_seed(0)
    module = GRPOModule(
        policy=PolicySpec("tiny"),
        lr=lr,
        lr_schedule="cosine",
        warmup_steps=2,
        num_minibatches=2,
        micro_batch_size=3,
        kl_coef=0.05,
        seed=3,
        **kw,
    )
    return _measure(_update(module, _grpo_batch), lambda: {"policy": module.live_policy})


def case_grpo_unpacked(tmp_path: Path) -> dict[str, float]:
    return case_grpo(tmp_path, pack_prompts=False, length_aware_micro_batches=False)


def case_vhgpo(tmp_path: Path) -> dict[str, float]:
    torch.manual_seed(0)
    module = VHGPOModule(
        policy=PolicySpec("tiny"),
        lr=1e-3,
        num_minibatches=2,
        micro_batch_size=4,
        lambda_resume=0.5,
        beta=0.2,
        seed=1,
    )

    def batch(tok: Any) -> RolloutBatch:
        b = _grpo_batch(tok)
        b.groups = b.groups[:2]
        b.relays = _relays(tok)
        return b

    return _measure(_update(module, batch), lambda: {"policy": module.live_policy})


# ---------------------------------------------------------------------- fits
def _trainer(tmp_path: Path, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=callbacks or [],
    )


class _ScriptedAgentData(AgentDataModule):
    def student(self) -> RightFromDepth:
        return RightFromDepth(self.trainer.lightning_module.tokenizer, self.fmt, 3)


def case_vhgpo_fit(tmp_path: Path) -> dict[str, float]:
    torch.manual_seed(0)
    module = VHGPOModule(policy=PolicySpec("tiny"), lr=1e-3, micro_batch_size=8)
    data = _ScriptedAgentData(
        env=EnvSpec(
            name="scripted",
            kwargs={"max_steps": 8},
            train_tasks={"num_tasks": 2, "length": 5, "actions": ["a", "b", "c"]},
        ),
        agent=AgentFormat(history_k=1),
        max_turns=8,
        tasks_per_step=2,
        group_size=4,
    )
    rescue = VerifiedHandoff(
        relay=RelayConfig(b_min=2, stride=2, max_backtracks=4, max_groups=2),
        teacher=TeacherSpec(kind="oracle"),
    )
    trainer = _trainer(tmp_path, [rescue])

    def run() -> tuple[dict[str, torch.nn.Module], dict[str, Any]]:
        trainer.fit(module, datamodule=data)
        return {"policy": module.live_policy}, dict(trainer.callback_metrics)

    return _measure(run, lambda: {"policy": module.live_policy})


class _ScriptedOutcomes(GraftDataModule):
    """Real rollouts of both models, outcomes overwritten: prompt 0 is complementary
    A -> B (A solved 1 of 4, B none), prompt 1 B -> A (B solved 2 of 4, A none)."""

    def train_rollout(self, tasks: Any) -> Any:
        batch = super().train_rollout(tasks)
        plan = {"a": [[1, 0, 0, 0], [0, 0, 0, 0]], "b": [[0, 0, 0, 0], [1, 1, 0, 0]]}
        for name, rows in plan.items():
            groups = batch.parts()[name].groups
            for g, succ in zip(groups, rows + [[0] * 4] * len(groups), strict=False):
                for t, ok in zip(g.trajectories, succ, strict=True):
                    t.success, t.reward = bool(ok), float(ok)
                assign_advantages(g, "grpo", 1e-6, 1e-6, 1e-6)
        return batch


def _graft(tmp_path: Path, **kw: Any) -> dict[str, float]:
    torch.manual_seed(0)
    module = GRAFTModule(lr=1e-3, lr_b=2e-3, num_minibatches=2, micro_batch_size=8, **kw)
    data = _ScriptedOutcomes(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=8),
        prompts_per_step=4,
        group_size=4,
        engine=EngineConfig(max_new_tokens=8),
    )
    trainer = _trainer(tmp_path)

    def models() -> dict[str, torch.nn.Module]:
        return {"a": module.a.live_policy, "b": module.b.live_policy}

    def run() -> tuple[dict[str, torch.nn.Module], dict[str, Any]]:
        trainer.fit(module, datamodule=data)
        return models(), dict(trainer.callback_metrics)

    return _measure(run, models)


def case_graft(tmp_path: Path) -> dict[str, float]:
    return _graft(tmp_path, kl_coef=0.02)


def case_sgt(tmp_path: Path) -> dict[str, float]:
    return _graft(tmp_path, mode="sgt")


def case_hacpo(tmp_path: Path) -> dict[str, float]:
    return _graft(tmp_path, mode="hacpo", restrict_to_selection=True)


def case_graft_variants(tmp_path: Path) -> dict[str, float]:
    return _graft(
        tmp_path,
        selection="random",
        peer_advantage="pooled",
        admission="random",
        delta=0.05,
        order="uniform",
        peer_loss="luffy",
    )


CASES: dict[str, Callable[[Path], dict[str, float]]] = {
    "grpo": case_grpo,
    "grpo_unpacked": case_grpo_unpacked,
    "vhgpo": case_vhgpo,
    "vhgpo_fit": case_vhgpo_fit,
    "graft": case_graft,
    "graft_variants": case_graft_variants,
    "sgt": case_sgt,
    "hacpo": case_hacpo,
}

# ---------------------------------------------------------------------- pinned numbers
PINNED: dict[str, dict[str, float]] = {
    "graft": {
        "a/param/sum": 316.5201825014228,
        "a/param/sumsq": 362.92176673143,
        "a/param/delta_abs": 178.01156158834948,
        "a/param/delta_sq": 0.2971654174366435,
        "a/param/model.layers.0.self_attn.q_proj.weight[0, 0]": 0.03055589273571968,
        "a/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.028935685753822327,
        "a/param/model.layers.1.input_layernorm.weight[3]": 1.0016677379608154,
        "a/param/model.norm.weight[0]": 1.0016705989837646,
        "b/param/sum": 324.0027840993989,
        "b/param/sumsq": 360.5446519319135,
        "b/param/delta_abs": 284.006269270824,
        "b/param/delta_sq": 0.9375121968401207,
        "b/param/model.layers.0.self_attn.q_proj.weight[0, 0]": -0.017475809901952744,
        "b/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.008493409492075443,
        "b/param/model.layers.1.input_layernorm.weight[3]": 0.9960724115371704,
        "b/param/model.norm.weight[0]": 0.9961499571800232,
        "grad/0/abs": 101.68398052268475,
        "grad/0/sq": 0.9700146973854193,
        "grad/1/abs": 0.4206468901185152,
        "grad/1/sq": 1.574199199767947e-05,
        "grad/2/abs": 95.19954367465918,
        "grad/2/sq": 0.9305815096485092,
        "grad/3/abs": 83.62004456837107,
        "grad/3/sq": 0.7308777179829314,
        "metric/a/loss/policy": -4.899011862846692e-09,
        "metric/a/loss/kl": 0.0019221175462007523,
        "metric/a/loss/total": 3.8437450712081045e-05,
        "metric/a/loss/clip_frac": 0.0,
        "metric/a/loss/peer_clip_frac": 0.0,
        "metric/a/loss/ratio_mean": 1.0132548809051514,
        "metric/a/train/grad_norm": 0.4944300055503845,
        "metric/b/loss/policy": 0.028402188792824745,
        "metric/b/loss/kl": 0.006086594890803099,
        "metric/b/loss/total": 0.028523921966552734,
        "metric/b/loss/clip_frac": 0.0625,
        "metric/b/loss/peer_clip_frac": 0.15625,
        "metric/b/loss/ratio_mean": 0.9805733561515808,
        "metric/b/train/grad_norm": 0.9097893238067627,
        "metric/graft/transferred_a_to_b": 1.0,
        "metric/graft/transferred_b_to_a": 1.0,
        "metric/graft/complementary_a_to_b": 1.0,
        "metric/graft/complementary_b_to_a": 1.0,
        "metric/graft/weight_mean": 0.5,
        "metric/graft/admitted_frac": 0.5,
        # 8 peer responses, 4 admitted: 1 of the 3 correct, 3 of the 5 incorrect
        "metric/graft/admitted_correct_frac": 0.3333333432674408,
        "metric/graft/admitted_incorrect_frac": 0.6000000238418579,
        "metric/graft/admission_gap": -0.2666666805744171,
        "metric/graft/peer_clip_frac": 0.078125,
    },
    "graft_variants": {
        "a/param/sum": 312.2651815911231,
        "a/param/sumsq": 362.6612221092828,
        "a/param/delta_abs": 79.43935179057581,
        "a/param/delta_sq": 0.0590830886565039,
        "a/param/model.layers.0.self_attn.q_proj.weight[0, 0]": 0.03149421513080597,
        "a/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.02987067401409149,
        "a/param/model.layers.1.input_layernorm.weight[3]": 1.000744104385376,
        "a/param/model.norm.weight[0]": 0.9992559552192688,
        "b/param/sum": 318.213075856911,
        "b/param/sumsq": 360.774329592655,
        "b/param/delta_abs": 329.2729674616882,
        "b/param/delta_sq": 1.0994050204339227,
        "b/param/model.layers.0.self_attn.q_proj.weight[0, 0]": -0.01811813749372959,
        "b/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.008055428974330425,
        "b/param/model.layers.1.input_layernorm.weight[3]": 0.996660053730011,
        "b/param/model.norm.weight[0]": 0.996660053730011,
        "grad/0/abs": 0.0,
        "grad/0/sq": 0.0,
        "grad/1/abs": 78.38386394618948,
        "grad/1/sq": 0.6388947781221238,
        "grad/2/abs": 95.19954644306912,
        "grad/2/sq": 0.9305815583885573,
        "grad/3/abs": 0.0,
        "grad/3/sq": 0.0,
        "metric/a/loss/policy": -0.06142975389957428,
        "metric/a/loss/total": -0.06142975389957428,
        "metric/a/loss/clip_frac": 0.0,
        "metric/a/loss/peer_clip_frac": 0.0,
        "metric/a/loss/ratio_mean": 1.0,
        "metric/a/train/grad_norm": 0.39965397119522095,
        "metric/b/loss/policy": -3.3298683255189587e-10,
        "metric/b/loss/total": -3.3298683255189587e-10,
        "metric/b/loss/clip_frac": 0.0,
        "metric/b/loss/peer_clip_frac": 0.0,
        "metric/b/loss/ratio_mean": 0.9939965605735779,
        "metric/b/train/grad_norm": 0.48233282566070557,
        "metric/graft/transferred_a_to_b": 1.0,
        "metric/graft/transferred_b_to_a": 1.0,
        "metric/graft/complementary_a_to_b": 1.0,
        "metric/graft/complementary_b_to_a": 1.0,
        "metric/graft/weight_mean": 0.865932285785675,
        "metric/graft/admitted_frac": 1.0,
        "metric/graft/admitted_incorrect_frac": 1.0,  # no correct peer response moved
        "metric/graft/peer_clip_frac": 0.0,
    },
    "grpo": {
        "policy/param/sum": 310.6464241457279,
        "policy/param/sumsq": 362.54036128361344,
        "policy/param/delta_abs": 67.27910058491756,
        "policy/param/delta_sq": 0.05240032990011258,
        "policy/param/model.layers.0.self_attn.q_proj.weight[0, 0]": 0.03184972330927849,
        "policy/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.03149732947349548,
        "policy/param/model.layers.1.input_layernorm.weight[3]": 1.0001927614212036,
        "policy/param/model.norm.weight[0]": 1.000986933708191,
        "grad/0/abs": 52.589425119203426,
        "grad/0/sq": 0.3210580418051021,
        "grad/1/abs": 92.46178212808289,
        "grad/1/sq": 0.7383159013095529,
        "metric/loss/policy": -0.04021285101771355,
        "metric/loss/kl": 0.002708306536078453,
        "metric/loss/total": -0.04007743299007416,
        "metric/loss/clip_frac": 0.11200001090765,
        "metric/loss/peer_clip_frac": 0.0,
        "metric/loss/ratio_mean": 1.0319344997406006,
        "metric/train/grad_norm": 0.712935209274292,
    },
    "grpo_unpacked": {
        "policy/param/sum": 310.646424106244,
        "policy/param/sumsq": 362.54036124015533,
        "policy/param/delta_abs": 67.27909982583782,
        "policy/param/delta_sq": 0.05240032862590276,
        "policy/param/model.layers.0.self_attn.q_proj.weight[0, 0]": 0.03184972330927849,
        "policy/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.03149732947349548,
        "policy/param/model.layers.1.input_layernorm.weight[3]": 1.0001927614212036,
        "policy/param/model.norm.weight[0]": 1.000986933708191,
        "grad/0/abs": 52.58942159228734,
        "grad/0/sq": 0.32105800818445496,
        "grad/1/abs": 92.46177859350527,
        "grad/1/sq": 0.7383158269857365,
        "metric/loss/policy": -0.04021284356713295,
        "metric/loss/kl": 0.002708306536078453,
        "metric/loss/total": -0.04007742553949356,
        "metric/loss/clip_frac": 0.1120000034570694,
        "metric/loss/peer_clip_frac": 0.0,
        "metric/loss/ratio_mean": 1.0319344997406006,
        "metric/train/grad_norm": 0.712935209274292,
    },
    "hacpo": {
        "a/param/sum": 319.5697585946764,
        "a/param/sumsq": 362.7763427835956,
        "a/param/delta_abs": 178.31274629201863,
        "a/param/delta_sq": 0.2976767708885226,
        "a/param/model.layers.0.self_attn.q_proj.weight[0, 0]": 0.030568795278668404,
        "a/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.032284848392009735,
        "a/param/model.layers.1.input_layernorm.weight[3]": 1.0016698837280273,
        "a/param/model.norm.weight[0]": 0.9983299374580383,
        "b/param/sum": 325.9252545145573,
        "b/param/sumsq": 360.5785487672295,
        "b/param/delta_abs": 329.29642777001976,
        "b/param/delta_sq": 1.099541485245737,
        "b/param/model.layers.0.self_attn.q_proj.weight[0, 0]": -0.018117405474185944,
        "b/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.014735009521245956,
        "b/param/model.layers.1.input_layernorm.weight[3]": 1.0033398866653442,
        "b/param/model.norm.weight[0]": 1.0033400058746338,
        "grad/0/abs": 111.82399098638795,
        "grad/0/sq": 0.9122044487191462,
        "grad/1/abs": 0.0,
        "grad/1/sq": 0.0,
        "grad/2/abs": 104.34663689868646,
        "grad/2/sq": 0.8412253549845411,
        "grad/3/abs": 0.0,
        "grad/3/sq": 0.0,
        "metric/a/loss/policy": -0.039208751171827316,
        "metric/a/loss/total": -0.039208751171827316,
        "metric/a/loss/clip_frac": 0.08383233845233917,
        "metric/a/loss/peer_clip_frac": 0.1367441713809967,
        "metric/a/loss/ratio_mean": 1.068984866142273,
        "metric/a/train/grad_norm": 0.4775463342666626,
        "metric/b/loss/policy": -0.06097336485981941,
        "metric/b/loss/total": -0.06097336485981941,
        "metric/b/loss/clip_frac": 0.0,
        "metric/b/loss/peer_clip_frac": 0.0,
        "metric/b/loss/ratio_mean": 1.002983808517456,
        "metric/b/train/grad_norm": 0.4585912823677063,
        "metric/graft/transferred_a_to_b": 4.0,
        "metric/graft/transferred_b_to_a": 4.0,
        "metric/graft/complementary_a_to_b": 1.0,
        "metric/graft/complementary_b_to_a": 1.0,
        "metric/graft/weight_mean": 1.0,
        "metric/graft/admitted_frac": 1.0,
        "metric/graft/admitted_correct_frac": 1.0,  # HACPO: every peer response enters
        "metric/graft/admitted_incorrect_frac": 1.0,
        "metric/graft/admission_gap": 0.0,
        "metric/graft/selected_a_to_b": 1.0,
        "metric/graft/selected_b_to_a": 1.0,
        "metric/graft/peer_clip_frac": 0.06837208569049835,
    },
    "sgt": {
        "a/param/sum": 317.28651157526474,
        "a/param/sumsq": 362.86861959323255,
        "a/param/delta_abs": 165.0081394136376,
        "a/param/delta_sq": 0.27776450623460436,
        "a/param/model.layers.0.self_attn.q_proj.weight[0, 0]": 0.03047558292746544,
        "a/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.030160291120409966,
        "a/param/model.layers.1.input_layernorm.weight[3]": 1.0015449523925781,
        "a/param/model.norm.weight[0]": 1.0009324550628662,
        "b/param/sum": 318.09599728655667,
        "b/param/sumsq": 360.6009145393832,
        "b/param/delta_abs": 304.22313846385686,
        "b/param/delta_sq": 1.0173824429704885,
        "b/param/model.layers.0.self_attn.q_proj.weight[0, 0]": -0.017542671412229538,
        "b/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.007980909198522568,
        "b/param/model.layers.1.input_layernorm.weight[3]": 0.9960241317749023,
        "b/param/model.norm.weight[0]": 0.9986656308174133,
        "grad/0/abs": 101.68398083734868,
        "grad/0/sq": 0.9700147025902347,
        "grad/1/abs": 46.43067753491553,
        "grad/1/sq": 0.2356025480250349,
        "grad/2/abs": 95.19954644306912,
        "grad/2/sq": 0.9305815583885573,
        "grad/3/abs": 32.6113585101227,
        "grad/3/sq": 0.10355353456776088,
        "metric/a/loss/policy": -5.587935447692871e-09,
        "metric/a/loss/total": -5.587935447692871e-09,
        "metric/a/loss/clip_frac": 0.0,
        "metric/a/loss/nll": 6.265296459197998,
        "metric/a/loss/ratio_mean": 0.9961774945259094,
        "metric/a/train/grad_norm": 0.7351404428482056,
        "metric/b/loss/policy": -4.656612873077393e-10,
        "metric/b/loss/total": -4.656612873077393e-10,
        "metric/b/loss/clip_frac": 0.0,
        "metric/b/loss/nll": 6.009343147277832,
        "metric/b/loss/ratio_mean": 0.9910109043121338,
        "metric/b/train/grad_norm": 0.6432314515113831,
        "metric/graft/transferred_a_to_b": 1.0,
        "metric/graft/transferred_b_to_a": 1.0,
    },
    "vhgpo": {
        "policy/param/sum": 311.47825228584225,
        "policy/param/sumsq": 362.61389160949705,
        "policy/param/delta_abs": 147.98520669843248,
        "policy/param/delta_sq": 0.23680510509511526,
        "policy/param/model.layers.0.self_attn.q_proj.weight[0, 0]": 0.030320268124341965,
        "policy/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.029236767441034317,
        "policy/param/model.layers.1.input_layernorm.weight[3]": 0.9996455311775208,
        "policy/param/model.norm.weight[0]": 1.001904845237732,
        "grad/0/abs": 107.8587269758825,
        "grad/0/sq": 1.0000002095894263,
        "grad/1/abs": 97.33766818307414,
        "grad/1/sq": 1.0000016340511948,
        "metric/loss/policy": 0.018801532685756683,
        "metric/loss/total": 0.018801532685756683,
        "metric/loss/clip_frac": 0.31961196660995483,
        "metric/loss/peer_clip_frac": 0.4285714030265808,
        "metric/loss/ratio_mean": 0.9493604302406311,
        "metric/train/grad_norm": 3.404168128967285,
        "metric/loss/pair": 0.7016553282737732,
        "metric/loss/bridge": 6.3279595375061035,
        "metric/loss/resume": 6.3254618644714355,
        "metric/loss/aux": 10.19234561920166,
        "metric/relay/pairs": 1.0,
        "metric/relay/bridge_turns": 3.0,
        "metric/relay/resume_turns": 1.0,
    },
    "vhgpo_fit": {
        "policy/param/sum": 308.67056530801347,
        "policy/param/sumsq": 362.55029599222934,
        "policy/param/delta_abs": 106.75822163023821,
        "policy/param/delta_sq": 0.10670588087257393,
        "policy/param/model.layers.0.self_attn.q_proj.weight[0, 0]": 0.031238598749041557,
        "policy/param/model.layers.1.mlp.down_proj.weight[1, 2]": 0.029614808037877083,
        "policy/param/model.layers.1.input_layernorm.weight[3]": 1.000999927520752,
        "policy/param/model.norm.weight[0]": 1.0010000467300415,
        "grad/0/abs": 90.49964903445544,
        "grad/0/sq": 1.0000029881962413,
        "metric/relay/zero_signal_groups": 2.0,
        "metric/relay/selected": 2.0,
        "metric/relay/teacher_attempts": 16.0,
        "metric/relay/recoveries": 2.0,
        "metric/relay/retained": 2.0,
        "metric/relay/zero_signal_groups_cum": 2.0,
        "metric/relay/selected_cum": 2.0,
        "metric/relay/teacher_attempts_cum": 16.0,
        "metric/relay/recoveries_cum": 2.0,
        "metric/relay/retained_cum": 2.0,
        "metric/relay/retained_frac_cum": 1.0,
        "metric/relay/teacher_frac": 0.6000000238418579,
        "metric/relay/pooled_reduction": 0.4000000059604645,
        "metric/loss/policy": 0.0,
        "metric/loss/total": 0.0,
        "metric/loss/clip_frac": 0.0,
        "metric/loss/ratio_mean": 0.002066895831376314,
        "metric/train/grad_norm": 8.625933647155762,
        "metric/loss/pair": 0.6931471824645996,
        "metric/loss/bridge": 6.215433597564697,
        "metric/loss/resume": 6.213710784912109,
        "metric/loss/aux": 13.122291564941406,
        "metric/relay/pairs": 2.0,
        "metric/relay/bridge_turns": 6.0,
        "metric/relay/resume_turns": 4.0,
    },
}


def _check(got: dict[str, float], want: dict[str, float]) -> None:
    assert sorted(got) == sorted(want)
    assert all(math.isfinite(v) for v in got.values())
    bad = {}
    for k in want:
        rel, abs_ = (METRIC_REL, METRIC_ABS) if k.startswith("metric/") else (REL, ABS)
        if got[k] != pytest.approx(want[k], rel=rel, abs=abs_):
            bad[k] = (got[k], want[k])
    assert not bad, bad


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_update_matches_the_pinned_numbers(case, tmp_path):
    _check(CASES[case](tmp_path), PINNED[case])


def test_the_pin_notices_a_changed_learning_rate(tmp_path):
    got = case_grpo(tmp_path, lr=1.01e-3)
    with pytest.raises(AssertionError):
        _check(got, PINNED["grpo"])
