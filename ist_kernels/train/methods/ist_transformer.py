"""``--method ist`` on a transformer or any model whose FFNs / attention heads are found from its
structure (``gpt_tiny``, ``gpt_small``, HF Llama / GPT-2, a user's ``nn.Sequential`` MLP; see
:func:`ist_kernels.partition.find_structure`): IST's partition of every FFN's hidden units
(``--option partition=ffn``, default), attention heads (``heads``) or both (``both``) among the S
workers (:func:`ist_kernels.partition.transformer_ist_plan`). Not a method of its own: ``ist``
(:mod:`.masked`) runs this class when its model is a language model.

Each round a fresh plan from ``ctx.generator(PLAN, r)`` (the same on every rank, never sent); each
worker trains its subnetwork (its units / heads, and everything shared: embeddings, positions,
norms, output biases) for ``local_steps``, then every slice goes to its next owner and the
shared tensors are averaged (the round engine's ``SubnetRounds``: decentralized storage by default,
a rank holds only its subnetwork; ``--storage replicated``; simulated). Optimizer state is fresh
every round (``momentum_state=reset``, as the MLP's ist), travels with the units (``aggregate``:
SGD momentum, AdamW's moments; ``int8`` / ``int8-v4``: block-wise coded; ``second``: the second
moment only) or stays with the worker that trained a unit (``local``): ``ist_kernels.train.rounds``. The full model scales the partitioned
output projections' inputs by 1/S (forward pre-hooks, nothing in the state dict): each branch is
the mean of the subnetworks' branches. ``ctx.model_spec`` (if the context has one) is the user's
explicit structure where discovery does not fit.
"""
from __future__ import annotations

from ...models.gpt import gpt_shape
from ...partition import PARTITIONS, check_ist, transformer_ist_plan
from ..rounds import SubnetRounds
from . import ConfigError, Method, RoundResult

PLAN = 0x157F  # generator tag of the round's plan


class TransformerIST(Method):
    name = "ist"

    @staticmethod
    def validate_transformer(hp, mlp_defaults) -> None:
        """The checks of ``ist`` on a transformer; ``mlp_defaults``: the MLP-only options' defaults
        (a value other than those was given and cannot apply)."""
        for key, default in mlp_defaults.items():
            if hp.options.get(key, default) != default:
                raise ConfigError(f"options.{key}", f"applies to ist on the mlp model, not to {hp.model!r}")
        partition = hp.options.get("partition", "ffn")
        if partition not in PARTITIONS:
            raise ConfigError("options.partition", f"expected one of {', '.join(PARTITIONS)}, got {partition!r}")
        width, _, heads = gpt_shape(hp.model, hp.width, hp.depth)
        S = hp.num_workers
        if partition != "ffn" and heads % S:
            raise ConfigError("options.partition", f"partition={partition}: {hp.model} of width {width} has {heads} "
                              f"attention heads, not divisible by the {S} workers (use partition=ffn, or a width "
                              f"whose heads of 32 S divides)")
        if partition != "heads" and 4 * width < S:
            raise ConfigError("workers", f"{S} workers but {hp.model} of width {width} has only {4 * width} FFN units")

    @staticmethod
    def validate_model(model, S: int, partition: str = "ffn", spec=None):
        """The checks of ``ist`` on a built model (any structure): what
        :func:`~ist_kernels.partition.check_ist` finds (FFNs, attentions) against ``S``, as a
        ConfigError naming ``options.partition`` (nothing found, heads not divisible) or ``workers``
        (fewer hidden units than workers). Returns the :class:`~ist_kernels.partition.Structure`."""
        try:
            return check_ist(model, S, partition, spec, who="ist")
        except ValueError as e:
            raise ConfigError("workers" if "hidden units" in str(e) else "options.partition", str(e)) from None

    def __init__(self, ctx):
        super().__init__(ctx)
        self.partition = ctx.options["partition"]
        self.spec = getattr(ctx, "model_spec", None)
        self.model = ctx.build_model()
        self.structure = self.validate_model(self.model, ctx.num_workers, self.partition, self.spec)
        self.full_state_bytes = ctx.full_state_bytes(self.model)
        # momentum_state: reset, aggregate, int8, int8-v4, second or local (rounds.py: a slice's state per option)
        self.rounds = SubnetRounds(ctx, self.model, ctx.options.get("momentum_state", "reset"), self.plan)
        first = self.rounds.plan(0)
        first.scale_outputs(self.model)  # the full model is scored as the mean of the subnetworks from round 0
        self.split = self.rounds.open(0, "ist", f" (partition={self.partition}) on {ctx.hp.model}", False)

    def plan(self, r: int):
        return transformer_ist_plan(self.model, self.ctx.num_workers, self.partition, self.ctx.generator(PLAN, r),
                                    spec=self.spec)

    def begin_round(self, r: int):
        return self.rounds.begin(r, last=r == self.ctx.rounds - 1)

    def end_round(self, r: int, losses) -> RoundResult:
        return self.rounds.end(r, losses)

    def global_model(self):
        return self.rounds.global_model()

    def summary(self):
        return {"partition": self.partition, **self.split}

    # plans come from (seed, round), optimizers are fresh every round and the scales are 1/S: the
    # model (decentralized: this rank's part) is all resume needs
    def state_dict(self):
        return self.rounds.state_dict()

    def load_state_dict(self, state):
        self.rounds.load_state_dict(state)

