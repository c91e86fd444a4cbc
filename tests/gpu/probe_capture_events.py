"""What CUDA answers to a query of an event recorded in a stream capture, and whether the query
breaks the capture: ``python tests/gpu/probe_capture_events.py`` prints one JSON object (run on
a GPU; the selftest's record in docs/gpu-runs.md cites it).  For each capture mode of the
capturing thread (global: torch.cuda.graph's default; thread_local; relaxed), another thread in
the thread-local mode (ncclpy's trackers) asks ``cudaStreamIsCapturing`` and queries the event
during the capture, then the capture is ended; the event is queried again after the end.  A
control run makes no query during the capture."""
from __future__ import annotations

import ctypes
import json
import threading
from typing import Any, Dict


def main() -> Dict[str, Any]:
    import cupy
    from cupy.cuda import runtime as rt
    drv = ctypes.CDLL("libcuda.so.1")
    drv.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
    out: Dict[str, Any] = {"cuda_runtime": rt.runtimeGetVersion(),
                           "driver": rt.driverGetVersion()}
    for name, mode in (("global", 0), ("thread_local", 1), ("relaxed", 2)):
        for query in (True, False):
            s = cupy.cuda.Stream(non_blocking=True)
            x = cupy.zeros(16, cupy.float32)
            ev = rt.eventCreateWithFlags(rt.eventDisableTiming)
            r: Dict[str, Any] = {}
            rt.streamBeginCapture(s.ptr, mode)
            with s:
                x += 1
            rt.eventRecord(ev, s.ptr)

            def other() -> None:
                m = ctypes.c_int(1)
                drv.cuThreadExchangeStreamCaptureMode(ctypes.byref(m))
                try:
                    r["other_thread_sees_capturing"] = bool(rt.streamIsCapturing(s.ptr))
                except Exception as e:  # noqa: BLE001 - recorded
                    r["other_thread_sees_capturing"] = f"{type(e).__name__}: {e}"
                if query:
                    r["query_during_capture"] = int(rt.eventQuery(ev))
            t = threading.Thread(target=other)
            t.start()
            t.join()
            try:
                g = rt.streamEndCapture(s.ptr)
                r["end_capture"] = "ok"
                rt.graphDestroy(g)
            except Exception as e:  # noqa: BLE001 - recorded
                r["end_capture"] = f"{type(e).__name__}: {e}"
            r["query_after_end"] = int(rt.eventQuery(ev))
            try:
                rt.getLastError()
            except Exception:  # noqa: BLE001 - cleared
                pass
            out[f"{name}{'' if query else '_no_query'}"] = r
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
