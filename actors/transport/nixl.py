"""NIXL (UCX backend) transport: one READ request per call, one descriptor per run.

Why pull (READ): the generation side knows where pages land, and it posts
the read only after it holds the context side's lease on the source pages.
The context side never writes into a generation worker, so a page it has
released can never be pushed into a generation request late; the reader
sees completion itself, and the lease is released over the control plane
afterwards. READs carry no notification; ``send_notif`` / ``get_notifs``
expose NIXL notifications only for small control messages.

Descriptors. At ``register`` every page of every group becomes one entry of a
prepared local dlist (``prep_xfer_dlist``); at ``connect`` the peer's pages
become a prepared remote dlist. A read expands its runs into entry indices::

    group offsets   [g0: 0 .. n0) [g1: n0 .. n0+n1)        (entry = offset[group] + page)
    PageRun(g1, src=7, dst=2, n=3)  ->  remote [o1+7, o1+8, o1+9], local [n0+2, n0+3, n0+4]

``make_prepped_xfer`` merges index neighbours that are adjacent in memory on
both sides, so each run goes out as ONE descriptor (``last_nixl_descriptors``
shows it when ``capture_telemetry=True``). Lists prepared once beat lists
built per read (``initialize_xfer``): a prepped request is cheaper to make,
and ``initialize_xfer`` does not merge, so per-page lists would go out
unmerged (measurements: docs/benchmarks.md, bench.transfer).

Memory: DRAM for CPU tensors, VRAM (device id = CUDA index) for CUDA ones.

Progress. A READ completes only when the *target* agent's UCX worker makes
progress (wire-up and completion; the cma data copy itself is one-sided), so
a process that serves reads (the context worker) needs the progress thread;
without it a read times out (``test_target_without_progress_times_out``).
A pure reader (the generation worker) may pass ``progress_delay_us=None``:
its own polling (``read``, ``get_notifs``) drives its worker, and its reads
are steadier so. The default (a thread that sleeps in poll(), 1 ms) is safe
for both.

UCX_TLS: left unset; UCX's own choice is as fast here as a forced one. To
force one anyway, give the actors ``runtime_env={"env_vars": {"UCX_TLS": ...}}``:
UCX reads it when the first agent of the process is created.

VRAM. UCX's cuda_ipc transport turns READs (get zcopy) off unless it sees
NVLink; on a GPU without NVLink peers (one H200 in a VM, here) a READ of
VRAM then fell back to tcp over loopback: 0.5 GB/s (docs/gpu.md,
"The last GPU measurement"). So where CUDA is present ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` defaults to
``yes``, unless the environment sets it. Not yet measured with it on.

Closing deregisters the pages and drops the agent, which ends its progress
thread and UCX worker now rather than at process exit.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from nixl import _bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from actors.transport.base import GroupRegion, KVTransport, PageRun, PeerUnreachable, TransferError, TransportMetadata

_MAX_POLL_SLEEP_S = 2e-4


class NixlTransport(KVTransport):
    """Transfers go through ``self.agent`` (STRICT sync: calls from several threads serialize)."""

    def __init__(self, agent_name: str, *, progress_delay_us: int | None = 1000,
                 capture_telemetry: bool = False, num_threads: int = 0) -> None:
        super().__init__(agent_name)
        self.agent = _make_agent(agent_name, progress_delay_us, capture_telemetry, num_threads)
        self.capture_telemetry = capture_telemetry
        self.last_nixl_descriptors: int | None = None
        self._reg_descs = None
        self._local_dlist = None
        self._remote_dlists: dict[str, object] = {}

    def _register(self, tensors: dict[str, torch.Tensor]) -> None:
        self._reg_descs = self.agent.register_memory(list(tensors.values()))
        self._local_dlist = self._prep_pages("", self.regions)

    def _agent_blob(self) -> bytes:
        return self.agent.get_agent_metadata()

    def _connect(self, peer: TransportMetadata) -> None:
        try:
            name = _text(self.agent.add_remote_agent(peer.agent_blob))
            if name != peer.agent_name:
                raise TransferError(f"NIXL blob names agent {name!r}, expected {peer.agent_name!r}")
            self._remote_dlists[peer.agent_name] = self._prep_pages(peer.agent_name, peer.regions)
            self.agent.make_connection(peer.agent_name)
        except TransferError:
            raise
        except Exception as e:
            raise PeerUnreachable(f"{self.agent_name}: cannot connect to {peer.agent_name!r}: {e!r}") from e

    def _disconnect(self, peer_name: str) -> None:
        dlist = self._remote_dlists.pop(peer_name, None)
        if dlist is not None:
            dlist.release()
        self.agent.remove_remote_agent(peer_name)

    def _read(self, peer: TransportMetadata, runs: list[PageRun], timeout_s: float) -> None:
        local_idx = _run_indices(runs, _offsets(self.regions), dst=True)
        remote_idx = _run_indices(runs, _offsets(peer.regions), dst=False)
        try:
            handle = self.agent.make_prepped_xfer(
                "READ", self._local_dlist, local_idx, self._remote_dlists[peer.agent_name], remote_idx)
        except Exception as e:
            raise PeerUnreachable(f"{self.agent_name}: cannot make READ from {peer.agent_name!r}: {e!r}") from e
        try:
            self._wait(handle, peer.agent_name, len(runs), timeout_s)
            if self.capture_telemetry:
                self.last_nixl_descriptors = self.agent.get_xfer_telemetry(handle).descCount
        except TransferError:
            raise
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer's process is gone
            raise PeerUnreachable(f"{self.agent_name}: READ from {peer.agent_name!r} failed: {e!r}") from e
        finally:
            _release(handle)

    def _wait(self, handle, peer_name: str, num_runs: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state, pause = self.agent.transfer(handle), 0.0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise PeerUnreachable(
                    f"READ of {num_runs} runs from {peer_name!r} timed out after {timeout_s}s; "
                    "the destination pages are undefined")
            time.sleep(pause)
            pause = min(max(2 * pause, 1e-5), _MAX_POLL_SLEEP_S)
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise PeerUnreachable(f"READ of {num_runs} runs from {peer_name!r} failed (NIXL state {state})")

    def _send_notif(self, peer_name: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer_name, message)
        except Exception as e:
            raise PeerUnreachable(f"{self.agent_name}: cannot notify {peer_name!r}: {e!r}") from e

    def get_notifs(self) -> list[tuple[str, bytes]]:
        arrived = self.agent.get_new_notifs()
        return [(_text(sender), bytes(m)) for sender, messages in arrived.items() for m in messages]

    def _prep_pages(self, agent_name: str, regions: dict[str, GroupRegion]):
        """One descriptor per page, groups back to back in ``regions`` order."""
        rows = np.concatenate([_page_rows(r) for r in regions.values()])
        mem_type = _mem_type(next(iter(regions.values())).device)
        return self.agent.prep_xfer_dlist(agent_name, rows, mem_type)

    def _close(self) -> None:
        if self._local_dlist is not None:
            self._local_dlist.release()
            self._local_dlist = None
        if self._reg_descs is not None:
            self.agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
        self.agent = None


def _make_agent(name: str, progress_delay_us: int | None, capture_telemetry: bool, num_threads: int) -> nixl_agent:
    """A UCX agent whose progress thread sleeps in poll() instead of spinning.

    ``nixl_agent`` hard-codes a progress delay of 0, which makes the thread
    spin a whole core per agent, idle or not (measured). The delay is only
    settable on the core config, so build the wrapper without a backend, swap
    in a core agent configured here, then add UCX. The thread wakes on UCX
    events; ``progress_delay_us`` (rounded up to 1 ms) bounds a missed wake-up.
    A READ completes only while its target progresses, so ``None`` (no
    thread) only suits a process that never serves reads.
    """
    if torch.cuda.is_available():  # module docstring, "VRAM" (without CUDA, UCX warns of an unused variable)
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "yes")  # read at create_backend
    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=sync))
    config = _bindings.nixlAgentConfig()
    config.useProgThread = progress_delay_us is not None
    config.pthrDelay = progress_delay_us or 0
    config.useListenThread = False
    config.syncMode = sync.value
    config.captureTelemetry = capture_telemetry
    agent.agent = _bindings.nixlAgent(name, config)
    if "UCX" not in agent.get_plugin_list():
        raise TransferError(f"{name}: NIXL has no UCX plugin (plugins: {agent.get_plugin_list()})")
    try:
        agent.create_backend("UCX", {"num_threads": str(num_threads)} if num_threads else {})
    except Exception as e:
        raise TransferError(f"{name}: cannot start NIXL's UCX backend ({e!r}); check UCX_TLS") from e
    return agent


def _page_rows(region: GroupRegion) -> np.ndarray:
    rows = np.empty((region.num_pages, 3), dtype=np.uint64)
    rows[:, 0] = region.base + np.arange(region.num_pages, dtype=np.uint64) * np.uint64(region.page_nbytes)
    rows[:, 1] = region.page_nbytes
    rows[:, 2] = _device_id(region.device)
    return rows


def _offsets(regions: dict[str, GroupRegion]) -> dict[str, int]:
    starts = np.cumsum([0] + [r.num_pages for r in regions.values()])
    return dict(zip(regions, starts.tolist()))


def _run_indices(runs: list[PageRun], offsets: dict[str, int], *, dst: bool) -> np.ndarray:
    """Entry indices of every page of every run, runs in order, pages ascending."""
    firsts = np.array([offsets[r.group] + (r.dst_page if dst else r.src_page) for r in runs], dtype=np.int64)
    counts = np.array([r.num_pages for r in runs], dtype=np.int64)
    run_starts = np.cumsum(counts) - counts
    return (np.arange(counts.sum()) + np.repeat(firsts - run_starts, counts)).astype(np.int32)


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def _mem_type(device: str) -> str:
    return "VRAM" if device.startswith("cuda") else "DRAM"


def _device_id(device: str) -> int:
    return torch.device(device).index or 0


def _release(handle) -> None:
    """Release a request; NIXL aborts it if still running (and logs if it cannot)."""
    try:
        handle.release()
    except Exception:  # the handle's finalizer keeps it on the agent's leak list
        pass
