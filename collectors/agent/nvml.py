"""GPUs through NVML (``pynvml``, from nvidia-ml-py, or a fake with its functions).

Readings are compared with the last ones and only changes go out: counters that rose, states
that changed (clock-event reasons, remapped rows pending or failed, the PCIe link's
generation and width against its maximum, NVLink links up or down), and temperature and power
when they moved by more than a step. XIDs and double-bit ECC errors come through NVML's event
API, waited for in a thread (``NvmlEvents``), so one is pushed within a second; NVML keeps
only the last event of a device between waits, so the wait never pauses.

pynvml's device handles are ctypes pointers, which compare by identity: the handle in an
event is a new pointer object, never ``==`` to the one the agent holds. Events are matched to
GPUs by UUID (``nvmlDeviceGetUUID`` of the event's handle), falling back to the address the
pointer holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collectors.knowledge import agent as proto
from collectors.knowledge import dcgm

log = logging.getLogger(__name__)

# NVML return codes (nvml.h), read from the error's ``value``.
ERROR_UNINITIALIZED = 1
ERROR_NOT_SUPPORTED = 3
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_FUNCTION_NOT_FOUND = 13
# nvml.h's field id of the memory (HBM) temperature, in degrees C.
FI_DEV_MEMORY_TEMP = 82
ERROR_GPU_IS_LOST = 15
ERROR_RESET_REQUIRED = 16
ERROR_LIB_RM_VERSION_MISMATCH = 18
# The driver went away (unloaded, reloaded, upgraded): initialise NVML again.
DRIVER_GONE = {ERROR_UNINITIALIZED, ERROR_DRIVER_NOT_LOADED, ERROR_LIB_RM_VERSION_MISMATCH}
GPU_GONE = {ERROR_GPU_IS_LOST, ERROR_RESET_REQUIRED}
# gpuInstanceId when the event is not about a MIG instance.
NO_INSTANCE = 0xFFFFFFFF

# A temperature or power change smaller than this is not news.
TEMP_STEP = 5.0  # degrees C
POWER_STEP = 0.10  # of the last pushed value


def error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def handle_address(handle: Any) -> int | None:
    """The address a ctypes pointer holds (what identifies the device); None for others."""
    with contextlib.suppress(TypeError, ctypes.ArgumentError):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass
class Gpu:
    index: int
    handle: Any
    uuid: str = ""
    name: str = ""
    pci: str = ""
    lost: bool = False
    last: dict[str, float] = field(default_factory=dict)  # the last values pushed


class NvmlSource:
    """The GPUs of this node. ``nvml`` is the pynvml module (or a fake with its functions)."""

    def __init__(self, node: str, nvml: Any) -> None:
        self.node, self.nvml = node, nvml
        self.gpus: list[Gpu] = []
        self.driver = ""
        self.reports: list[dict[str, Any]] = []  # the agent's own news, sent with the next poll
        # Held around every NVML call of the event thread and around a restart of NVML, so
        # NVML is never shut down under a wait in progress.
        self.lock = threading.RLock()
        self.ready = False
        # Counts NVML starts: the event thread registers again on new handles when it moves.
        self.generation = 0
        # After an in-place driver upgrade pynvml cannot load the new library: the process
        # must start again (the agent exits with EXIT_RESTART; systemd or the kubelet restart it).
        self.restart_needed = False
        self._unavailable = ""  # the last reason reported, so it is reported once
        self._start()

    # --- set-up -------------------------------------------------------------------------

    def _start(self) -> None:
        nvml = self.nvml
        nvml.nvmlInit()
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except nvml.NVMLError as exc:
                # One GPU off the bus (or hidden from this container) leaves the others read.
                gpus.append(Gpu(i, None, lost=True))
                self._report(proto.GPU_LOST, f"NVML: GPU {i} answers: {exc}", gpu=i)
                continue
            gpu = Gpu(i, handle)
            for name, call in (("uuid", nvml.nvmlDeviceGetUUID), ("name", nvml.nvmlDeviceGetName)):
                with contextlib.suppress(nvml.NVMLError):
                    setattr(gpu, name, _text(call(handle)))
            with contextlib.suppress(nvml.NVMLError, AttributeError):
                gpu.pci = _text(nvml.nvmlDeviceGetPciInfo(handle).busId).lower()
            gpus.append(gpu)
        with contextlib.suppress(nvml.NVMLError):
            self.driver = _text(nvml.nvmlSystemGetDriverVersion())
        before = len(self.gpus)
        self.gpus = gpus
        self.generation += 1
        if self.ready and before != len(gpus):
            self._report(proto.GPU_COUNT_CHANGED, f"NVML lists {len(gpus)} GPUs, {before} before",
                         before=before, now=len(gpus))
        self.ready = True

    def _report(self, event: str, message: str, gpu: int | None = None, **extra: Any) -> None:
        record: dict[str, Any] = {"source": "dcgm", "node": self.node, "via": "nvml",
                                  "event": event, "message": message, **extra}
        if gpu is not None:
            record["gpu"] = gpu
        self.reports.append(record)

    def describe(self) -> str:
        models = sorted({g.name for g in self.gpus if g.name})
        return (f"{len(self.gpus)} GPU(s) {', '.join(models) or ''} driver {self.driver or '?'}"
                .replace("  ", " "))

    def reinit(self, why: str) -> None:
        """The driver went away: start NVML again, or say (once) it is unavailable."""
        with self.lock:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
            try:
                self._start()
            except Exception as exc:
                self.ready = False
                if error_code(exc) == ERROR_LIB_RM_VERSION_MISMATCH:
                    self.restart_needed = True
                if str(exc) != self._unavailable:  # said once, not on every poll
                    self._unavailable = str(exc)
                    self._report(proto.NVML_UNAVAILABLE, f"NVML unavailable ({why}): {exc}")
                return
        self._unavailable = ""
        self._report(proto.NVML_REINIT, f"NVML started again after: {why}")

    # --- matching -----------------------------------------------------------------------

    def gpu_of(self, handle: Any) -> int | None:
        """The index of the GPU an event's handle names."""
        with contextlib.suppress(self.nvml.NVMLError):
            uuid = _text(self.nvml.nvmlDeviceGetUUID(handle))
            for gpu in self.gpus:
                if gpu.uuid and gpu.uuid == uuid:
                    return gpu.index
        address = handle_address(handle)
        for gpu in self.gpus:
            if gpu.handle is handle or (address is not None
                                        and handle_address(gpu.handle) == address):
                return gpu.index
        if isinstance(handle, int):  # fakes without pointers
            return next((g.index for g in self.gpus if g.handle == handle), None)
        return None

    # --- readings -----------------------------------------------------------------------

    def _read(self, gpu: Gpu) -> dict[str, float]:
        """This GPU's fields NVML has (a field the GPU does not support is left out)."""
        nvml, h = self.nvml, gpu.handle
        calls: list[tuple[str, Callable[[], float]]] = [
            (dcgm.GPU_TEMP, lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            (dcgm.MEMORY_TEMP, lambda: self._memory_temp(h)),
            (dcgm.POWER_USAGE, lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),  # mW -> W
            (dcgm.GPU_UTIL, lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            (dcgm.CLOCKS_EVENT_REASONS, lambda: self._clock_reasons(h)),
            (dcgm.ECC_DBE_VOL_TOTAL, lambda: nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
            (dcgm.ECC_SBE_VOL_TOTAL, lambda: nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)),
            (dcgm.PCIE_LINK_GEN, lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            (dcgm.PCIE_LINK_WIDTH, lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
            (dcgm.PCIE_MAX_LINK_GEN, lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
            (dcgm.PCIE_MAX_LINK_WIDTH, lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(h)),
            (dcgm.PCIE_REPLAY_COUNTER, lambda: nvml.nvmlDeviceGetPcieReplayCounter(h)),
        ]
        out: dict[str, float] = {}
        for name, call in calls:
            try:
                out[name] = float(call())
            except nvml.NVMLError as exc:
                if error_code(exc) in GPU_GONE | DRIVER_GONE:
                    raise
            except AttributeError:  # an older pynvml without the call
                continue
        try:
            _corr, unc, pending, failure = nvml.nvmlDeviceGetRemappedRows(h)
            out[dcgm.UNCORRECTABLE_REMAPPED_ROWS] = float(unc)
            out[dcgm.ROW_REMAP_PENDING] = float(bool(pending))
            out[dcgm.ROW_REMAP_FAILURE] = float(bool(failure))
        except nvml.NVMLError as exc:  # not on GPUs before Ampere
            if error_code(exc) in GPU_GONE | DRIVER_GONE:
                raise
        out.update(self._nvlink(gpu))
        return out

    def _memory_temp(self, handle: Any) -> float:
        """HBM temperature: a field value only (NVML_FI_DEV_MEMORY_TEMP), on GPUs that have it."""
        nvml = self.nvml
        [value] = nvml.nvmlDeviceGetFieldValues(handle, [FI_DEV_MEMORY_TEMP])
        if value.nvmlReturn != 0:
            raise nvml.NVMLError(value.nvmlReturn)
        return float(value.value.uiVal)

    def _clock_reasons(self, handle: Any) -> int:
        """The clock-event reasons; drivers before R535 have only the older name."""
        nvml = self.nvml
        try:
            return int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        except (AttributeError, nvml.NVMLError) as exc:
            if isinstance(exc, nvml.NVMLError) and error_code(exc) != ERROR_FUNCTION_NOT_FOUND:
                raise
            return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))

    def _nvlink(self, gpu: Gpu) -> dict[str, float]:
        """Links down among those that were up at start, and the error counters summed."""
        nvml, h = self.nvml, gpu.handle
        counters = {dcgm.NVLINK_CRC_FLIT_ERRORS: "NVML_NVLINK_ERROR_DL_CRC_FLIT",
                    dcgm.NVLINK_CRC_DATA_ERRORS: "NVML_NVLINK_ERROR_DL_CRC_DATA",
                    dcgm.NVLINK_REPLAY_ERRORS: "NVML_NVLINK_ERROR_DL_REPLAY",
                    dcgm.NVLINK_RECOVERY_ERRORS: "NVML_NVLINK_ERROR_DL_RECOVERY"}
        out: dict[str, float] = {}
        down = 0
        links = 0
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0))):
            try:
                active = bool(nvml.nvmlDeviceGetNvLinkState(h, link))
            except nvml.NVMLError as exc:
                if error_code(exc) in GPU_GONE | DRIVER_GONE:
                    raise
                continue  # no such link on this GPU
            links += 1
            key = f"link-{link}"  # remembered beside the readings
            if active:
                gpu.last.setdefault(key, 1.0)
            elif gpu.last.get(key):
                down += 1  # was up, is down
            for name, counter in counters.items():
                with contextlib.suppress(nvml.NVMLError, AttributeError):
                    out[name] = out.get(name, 0.0) + float(
                        nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, getattr(nvml, counter)))
        if links:
            out[proto.NVLINK_LINKS_DOWN] = float(down)
        return out

    def poll(self) -> list[dict[str, Any]]:
        """What changed since the last poll, and the agent's reports about NVML itself."""
        if not self.ready:
            self.reinit("NVML was unavailable")
            return self._take_reports()
        out: list[dict[str, Any]] = []
        for gpu in list(self.gpus):
            if gpu.handle is None:
                continue  # no handle at NVML's start: reported then; found again at a restart
            try:
                now = self._read(gpu)
            except self.nvml.NVMLError as exc:
                code = error_code(exc)
                if code in DRIVER_GONE:
                    self.reinit(str(exc))
                    return self._take_reports() + out
                if not gpu.lost:
                    gpu.lost = True
                    self._report(proto.GPU_LOST, f"NVML: GPU {gpu.index} ({gpu.uuid or '?'}) "
                                 f"answers: {exc}", gpu=gpu.index, uuid=gpu.uuid, pci=gpu.pci)
                continue
            if gpu.lost:
                gpu.lost = False
                self._report(proto.GPU_BACK, f"NVML: GPU {gpu.index} answers again",
                             gpu=gpu.index, uuid=gpu.uuid)
            out += self._changes(gpu, now)
        return self._take_reports() + out

    def _take_reports(self) -> list[dict[str, Any]]:
        reports, self.reports = self.reports, []
        return reports

    def _changes(self, gpu: Gpu, now: dict[str, float]) -> list[dict[str, Any]]:
        base = {"source": "dcgm", "node": self.node, "gpu": gpu.index, "via": "nvml"}
        if gpu.uuid:
            base["uuid"] = gpu.uuid
        out = []
        first = not any(k in gpu.last for k in now)
        for name, value in now.items():
            before = gpu.last.get(name)
            if not self._news(name, before, value, first, now):
                continue
            record = {**base, "metric": name, "value": value}
            if before is not None:
                record["previous"] = before
            if name in (dcgm.PCIE_LINK_GEN, dcgm.PCIE_LINK_WIDTH):
                top = now.get(dcgm.PCIE_MAX_LINK_GEN if name == dcgm.PCIE_LINK_GEN
                              else dcgm.PCIE_MAX_LINK_WIDTH)
                if top is not None:
                    record["max"] = top
            out.append(record)
            gpu.last[name] = value
        for name, value in now.items():
            gpu.last.setdefault(name, value)
        return out

    @staticmethod
    def _news(name: str, before: float | None, value: float, first: bool,
              now: dict[str, float]) -> bool:
        """Whether a reading is worth pushing."""
        if name == dcgm.CLOCKS_EVENT_REASONS:
            # A GPU in slowdown is reported on every poll while it lasts ("sustained"), and
            # once more when it ends.
            return bool((int(value) | int(before or 0)) & dcgm.SLOW_BITS) or (
                before is not None and int(before) != int(value))
        if name in (dcgm.PCIE_LINK_GEN, dcgm.PCIE_LINK_WIDTH):
            top = now.get(dcgm.PCIE_MAX_LINK_GEN if name == dcgm.PCIE_LINK_GEN
                          else dcgm.PCIE_MAX_LINK_WIDTH)
            # A link below its maximum is news on the first reading too (trained low at boot).
            # An idle GPU lowers its link generation to save power: only the width, or a
            # generation below the maximum while busy, means a bad link; diagnosis decides.
            return (before is None and top is not None and value < top) or (
                before is not None and before != value)
        if name in (dcgm.PCIE_MAX_LINK_GEN, dcgm.PCIE_MAX_LINK_WIDTH, dcgm.GPU_UTIL):
            return False  # context for other readings, not news by itself
        if name in (dcgm.ROW_REMAP_PENDING, dcgm.ROW_REMAP_FAILURE, proto.NVLINK_LINKS_DOWN):
            return (before is None and value > 0) or (before is not None and before != value)
        if name in (dcgm.GPU_TEMP, dcgm.MEMORY_TEMP):
            return before is not None and abs(value - before) >= TEMP_STEP
        if name == dcgm.POWER_USAGE:
            return before is not None and abs(value - before) >= POWER_STEP * max(before, 1.0)
        # Counters: news when they rise (a reset to 0, a driver reload, is not a fault).
        return before is not None and value > before

    def utilisation(self) -> dict[int, float | None]:
        return {g.index: g.last.get(dcgm.GPU_UTIL) for g in self.gpus}


class NvmlEvents:
    """XID and double-bit ECC events, waited for in a thread. ``deliver`` receives each as a
    pushed record the moment NVML hands it over."""

    WAIT_MS = 1000  # how long one wait blocks: the thread checks for a stop this often

    def __init__(self, source: NvmlSource, deliver: Callable[[list[dict[str, Any]]], None]) -> None:
        self.source, self.deliver = source, deliver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self.events: Any = None
        self.generation = -1  # the NVML start the event set belongs to

    def _register(self) -> None:
        """A new event set on the GPUs NVML has now (after a restart of NVML, new handles);
        the old set is freed."""
        source, nvml = self.source, self.source.nvml
        with source.lock:
            self._free()
            self.generation = source.generation
            if not source.ready:
                return
            self.events = nvml.nvmlEventSetCreate()
            wanted = nvml.nvmlEventTypeXidCriticalError | getattr(
                nvml, "nvmlEventTypeDoubleBitEccError", 0)
            for gpu in source.gpus:
                if gpu.handle is None:
                    continue
                types = wanted
                with contextlib.suppress(nvml.NVMLError, AttributeError):
                    types &= int(nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle))
                if not types:
                    log.warning("GPU %d: NVML offers no XID events", gpu.index)
                    continue
                try:
                    nvml.nvmlDeviceRegisterEvents(gpu.handle, types, self.events)
                except nvml.NVMLError as exc:  # some GPUs (or MIG modes) do not support events
                    log.warning("GPU %d: NVML events unavailable: %s", gpu.index, exc)

    def _free(self) -> None:
        if self.events is not None:
            with contextlib.suppress(Exception):
                self.source.nvml.nvmlEventSetFree(self.events)
            self.events = None

    def start(self) -> None:
        self._register()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.WAIT_MS / 1000 + 2)
        with self.source.lock:
            self._free()

    def _run(self) -> None:
        nvml = self.source.nvml
        complaint = ""
        while not self._stop.is_set():
            try:
                if self.events is None or self.generation != self.source.generation:
                    if not self.source.ready:  # NVML is down: the poll restarts it
                        self._stop.wait(2.0)
                        continue
                    self._register()
                with self.source.lock:
                    event = nvml.nvmlEventSetWait_v2(self.events, self.WAIT_MS)
            except nvml.NVMLError as exc:
                if error_code(exc) == ERROR_TIMEOUT or isinstance(
                        exc, getattr(nvml, "NVMLError_Timeout", ())):
                    continue
                # A GPU lost or the driver gone: the poll reports it and restarts NVML when
                # it must; meanwhile a fresh event set every few seconds.
                if str(exc) != complaint:
                    complaint = str(exc)
                    log.warning("NVML event wait failed: %s", exc)
                self.generation = -1
                self._stop.wait(2.0)
                continue
            except Exception:  # never let the thread die silently
                log.exception("NVML event wait failed")
                self._stop.wait(2.0)
                continue
            complaint = ""
            try:
                self.deliver([self.record(event)])
            except Exception:
                log.exception("an NVML event could not be delivered")

    def record(self, event: Any) -> dict[str, Any]:
        source, nvml = self.source, self.source.nvml
        index = source.gpu_of(event.device)
        is_dbe = int(event.eventType) == getattr(nvml, "nvmlEventTypeDoubleBitEccError", -1)
        record: dict[str, Any] = {"source": "dcgm", "node": source.node, "gpu": index,
                                  "via": "nvml"}
        if is_dbe:
            record.update(metric=dcgm.ECC_DBE_VOL_TOTAL, value=1, event="dbe")
        else:
            record.update(metric=dcgm.XID_ERRORS, value=int(event.eventData))
        gi = int(getattr(event, "gpuInstanceId", NO_INSTANCE))
        if gi != NO_INSTANCE:
            record["gpu_instance"] = gi
            record["compute_instance"] = int(getattr(event, "computeInstanceId", NO_INSTANCE))
        if index is not None and source.gpus[index].uuid:
            record["uuid"] = source.gpus[index].uuid
        return record
