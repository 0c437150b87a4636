"""What the pool starts: each replica's model, engine and batching, and the replicas on a Ray cluster.

`ReplicaSettings` and `PoolSettings` are the `replica` and `pool` sections of `ServeConfig`
(cloud/config.py) themselves: each setting's default, help and bounds are written here once, and the
specs carry the sections whole. Free of torch, Ray and gRPC, so configuration (cloud/config.py, the
CLI) can be read and checked before anything heavy is imported. A replica's own gRPC endpoint is not a
setting here: the layer that serves gRPC hands the pool an endpoint to start (cloud/api/server.py,
`ReplicaEndpoint`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...common.config import DType, check_fields, device_setting, setting
from ..core.limits import (DEFAULT_FAIR_SHARE, DEFAULT_HOLD, DEFAULT_MAX_BATCH, DEFAULT_MAX_WAIT_MS,
                           DEFAULT_PREFILL_BUDGET_MS, Hold,
                           VerifierLimits)
from ..engine.kinds import EngineKind


@dataclass(frozen=True)
class ReplicaSettings:
    """What each replica computes with and how it batches (ServeConfig's `replica` section)."""

    engine: EngineKind = setting(EngineKind.AUTO, "what computes the target: llamacpp serves its GGUF file on a "
                                                  "CPU; torch its Hugging Face weights; auto = llamacpp on a CPU "
                                                  "when the target has a GGUF file and dtype is auto, else torch")
    device: str = device_setting("where each replica computes")
    dtype: DType = setting(DType.AUTO, "the target's weights in each replica (torch engine; llama.cpp serves the "
                                       "GGUF's own type); auto = float32 on a CPU, bfloat16 on a GPU")
    torch_threads: int = setting(0, "compute threads per replica on a CPU; 0 = the engine's default (torch's "
                                    "own, 1 for llama.cpp)", ge=0)
    max_batch_size: int = setting(DEFAULT_MAX_BATCH, "most rounds scored in one forward pass; 1 turns batching off",
                                  ge=1)
    max_wait_ms: float = setting(DEFAULT_MAX_WAIT_MS, "a round waits at most this long for others to batch with",
                                 ge=0)
    hold: Hold = setting(DEFAULT_HOLD, "which others a queued round waits for: company = every session that "
                                       "sent a round lately, up to max_wait; cohort = those the same pass "
                                       "answered (groups that draft while another is verified); quorum = nine in ten "
                                       "of them, up to the last pass's time (one group); auto = quorum while "
                                       "edges come back sooner than a pass's fixed part, else cohort")
    pass_cost_tokens: int = setting(32, "a replica times passes of 1 to this many tokens and reports the curve "
                                        "to edges, which size their blocks by it: kept from an earlier start on "
                                        "the same model, engine and machine ($HYBRIDSPEC_HOME/pass-costs), else "
                                        "measured while it serves; 0 = do not measure", ge=0)
    prefill_budget_ms: float = setting(DEFAULT_PREFILL_BUDGET_MS, "while others wait, a pass takes about this "
                                                                  "long: one carrying a prompt chunk beside other "
                                                                  "sessions' rounds, and one shared by several "
                                                                  "identities", gt=0)
    fair_share: bool = setting(DEFAULT_FAIR_SHARE, "share each pass among the identities with work by weight, "
                                                   "in measured pass time (an identity alone gets all of it); "
                                                   "off: rounds go by arrival")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica loads (`target`, resolved by the caller) and runs it with: its settings and the
    verifier's limits, each a section of ServeConfig handed on whole."""

    target: str  # model directory, .gguf file or cached hub id
    settings: ReplicaSettings = ReplicaSettings()
    limits: VerifierLimits = VerifierLimits()


@dataclass(frozen=True)
class PoolSettings:
    """The Ray pool: its replicas' number and resources, the cluster it runs on, sessions per caller
    (ServeConfig's `pool` section)."""

    replicas: int = setting(1, "Ray replicas, each with its own copy of the target", ge=1)
    replica_num_cpus: float = setting(1.0, "Ray CPUs reserved per replica (fractions allowed)", ge=0)
    replica_num_gpus: float = setting(0.0, "Ray GPUs per replica (1 on a GPU cluster)", ge=0)
    ray_address: str = setting("", "the Ray cluster to join: its head's HOST:PORT, auto (the one `ray start` "
                                   "made on this machine, or RAY_ADDRESS) or ray://HOST:10001; empty: start a "
                                   "local one, whatever RAY_ADDRESS says")
    ray_join_timeout_s: float = setting(30.0, "joining a cluster: how long its head may take to answer before "
                                              "the server gives up with an error", gt=0)
    ray_num_cpus: int = setting(0, "CPUs a local cluster advertises; 0 = every core", ge=0)
    ray_local_only: bool = setting(True, "a cluster this server starts listens on 127.0.0.1 only and admits "
                                         "no other node")
    model_process: bool = setting(True, "each replica runs its model in a process of its own beside the actor, "
                                        "so that Ray's calls and the replica's gRPC endpoint never take turns with "
                                        "the model loop for one interpreter; off: in the actor's own process")
    replica_niceness: int = setting(0, "scheduling niceness of each replica's process (Ray starts its workers at "
                                       "15, which makes a replica yield its core to everything else on the node)",
                                    ge=0, le=19)
    max_sessions_per_client: int = setting(32, "sessions one token identity may hold over the whole pool; more "
                                               "get RESOURCE_EXHAUSTED", ge=1)
    max_sessions_per_address: int = setting(32, "the same for callers without a token, per address", ge=1)
    replica_wait_s: float = setting(30.0, "with every replica down, a new session waits this long for one to "
                                          "restart", ge=0)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class PoolSpec:
    """The replicas to start (each `replica`), the pool's settings, and the prefix of the replicas'
    actor names."""

    replica: ReplicaSpec
    settings: PoolSettings = PoolSettings()
    name: str = "hybridspec"
