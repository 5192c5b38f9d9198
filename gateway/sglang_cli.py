"""`sluice serve --driver sglang` flags: the SGLang servers and cache-aware routing (docs/sglang.md)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gateway.settings import Settings, comma_list

if TYPE_CHECKING:
    from drivers.sglang.config import SGLangConfig
    from observability.node_health import NodeHealthConfig


def add_sglang_arguments(p: argparse.ArgumentParser, env: Settings) -> None:
    from drivers.sglang.config import CacheRoutingConfig, SGLangConfig

    r = CacheRoutingConfig()
    g = p.add_argument_group("sglang (--driver sglang: SGLang servers over HTTP; see docs/sglang.md)")
    g.add_argument("--sglang-servers", default=",".join(env.sglang_servers), metavar="URL,...",
                   help="SGLang server base URLs, comma-separated (SLUICE_SGLANG_SERVERS)")
    g.add_argument("--sglang-kv-events", default=",".join(env.sglang_kv_events), metavar="ZMQ,...",
                   help="the servers' KV event endpoints, one per server in order (SLUICE_SGLANG_KV_EVENTS)")
    g.add_argument("--sglang-kv-replay", default=",".join(env.sglang_kv_replay), metavar="ZMQ,...",
                   help="their replay endpoints, same order (SLUICE_SGLANG_KV_REPLAY)")
    g.add_argument("--sglang-snapshot", default=env.sglang_snapshot, metavar="PATH",
                   help="file the approximate routing trees are saved to and loaded from (SLUICE_SGLANG_SNAPSHOT)")
    g.add_argument("--sglang-balance-abs", type=int, default=r.balance_abs,
                   help="load-imbalance guard: requests between busiest and idlest before cache is ignored")
    g.add_argument("--sglang-balance-rel", type=float, default=r.balance_rel,
                   help="load-imbalance guard: busiest / idlest ratio before cache is ignored")
    g.add_argument("--sglang-min-match", type=int, default=r.min_match_tokens,
                   help="cached prefix tokens worth routing for; shorter goes least-loaded")
    g.add_argument("--sglang-max-attempts", type=int, default=SGLangConfig.max_attempts,
                   help="servers one request may be tried on")


def sglang_config(args: argparse.Namespace, env: Settings, node_health: NodeHealthConfig) -> SGLangConfig:
    from drivers.sglang.config import CacheRoutingConfig, SGLangConfig

    try:
        return SGLangConfig(
            servers=comma_list(args.sglang_servers), kv_events=comma_list(args.sglang_kv_events),
            kv_replay=comma_list(args.sglang_kv_replay), api_key=env.sglang_api_key,
            chat_template=env.sglang_chat_template, snapshot_path=args.sglang_snapshot or None,
            routing=CacheRoutingConfig(balance_abs=args.sglang_balance_abs, balance_rel=args.sglang_balance_rel,
                                       min_match_tokens=args.sglang_min_match),
            node_health=node_health, max_attempts=args.sglang_max_attempts,
        )
    except ValueError as exc:  # a misconfigured driver is a usage error, not a traceback
        raise SystemExit(f"sluice: {exc}") from exc
