"""The table of ``docs/performance.md`` from a JSON file ``python -m bench.scale --json`` wrote
(``python -m bench.scale --markdown PATH`` prints it)."""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["markdown"]


def markdown(data: Dict[str, Any]) -> str:
    """The results as the table of ``docs/performance.md``."""
    rows = ["| ranks | spread s | fault | store req/s | store CPU (1 core) | µs/req | beat p50 / "
            "p99 ms | unrelated get p99 ms | false aborts | checked call ms (p50 / p99) | store "
            "ms/call | keys after | connections | named by (max s after the stop or kill) |",
            "|" + "---|" * 14]
    for r in data["results"]:
        def ms(k: str) -> str:
            return "" if r.get(k) is None else f"{1e3 * r[k]:.1f}"
        chk = (f"{r['checked_call_ms']:.1f} / {r['checked_call_p99_ms']:.1f}"
               if r.get("checked_call_ms") is not None else "")
        if r.get("fault") == "pause":     # healthy pauses: any verdict is a false abort
            named = "paused " + ", ".join(f"{p} s" if isinstance(p, (int, float)) else str(p)
                                          for p in r.get("pauses_s", ()))
        elif r.get("fault"):
            named = f"{r['named_by']}/{r['of']} ({r['detect_max_s']} s)"
        else:
            named = ""
        rows.append(f"| {r['ranks']} | {r['spread_s']} | {r.get('fault') or ''} | "
                    f"{r['store_requests_per_s']} | {100 * r['store_cpu_fraction']:.1f} % | "
                    f"{r['store_cpu_us_per_request']} | {ms('beat_p50_s')} / {ms('beat_p99_s')} | "
                    f"{r['unrelated_get_p99_ms']} | {r['false_aborts']} | {chk} | "
                    f"{r.get('checked_store_cpu_ms', '')} | {r['store_keys_after']} | "
                    f"{r['connections']} | {named} |")
    k = data.get("checked_keys")
    if k:
        rows.append(f"\nKey count over {k['rounds']:,} checked calls of 2 ranks (real Checker): "
                    f"{k['keys_before']} before, {k['keys_after']} after ({k['seconds']} s).")
    return "\n".join(rows)
