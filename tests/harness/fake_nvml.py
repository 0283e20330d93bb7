"""A fake NVML with pynvml's functions, errors and handle types, over GPUs a test changes.

Faithful where the agent could go wrong: device handles are ctypes pointers of pynvml's own
``c_nvmlDevice_t`` type, and every call hands out a new pointer object (as pynvml does), so
two handles to one GPU are never ``==``; event data is pynvml's ``c_nvmlEventData_t``; errors
are pynvml's ``NVMLError`` classes built from NVML's return codes; ``nvmlEventSetWait_v2``
blocks for its timeout like the real one and keeps only the last event per GPU between waits.
"""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace
from typing import Any

import pynvml

NO_INSTANCE = 0xFFFFFFFF


def healthy_gpu() -> dict[str, Any]:
    return dict(util=90, temp=60, memory_temp=70, power=400_000, clocks=0, dbe=0, sbe=0, remap=(0, 0, 0, 0),
                pcie_gen=5, pcie_width=16, pcie_max_gen=5, pcie_max_width=16, replay=0,
                nvlink=[True, True, True, True], nvlink_errors=0, lost=False,
                supported=True)


class FakeNvml:
    # pynvml's error classes and constants, so the agent sees what it would on a GPU node.
    NVMLError = pynvml.NVMLError
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_MEMORY_ERROR_TYPE_CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    nvmlEventTypeDoubleBitEccError = pynvml.nvmlEventTypeDoubleBitEccError
    NVML_NVLINK_MAX_LINKS = 4  # a small GPU, to keep tests short
    NVML_NVLINK_ERROR_DL_REPLAY = pynvml.NVML_NVLINK_ERROR_DL_REPLAY
    NVML_NVLINK_ERROR_DL_RECOVERY = pynvml.NVML_NVLINK_ERROR_DL_RECOVERY
    NVML_NVLINK_ERROR_DL_CRC_FLIT = pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT
    NVML_NVLINK_ERROR_DL_CRC_DATA = pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA

    def __init__(self, count: int = 2) -> None:
        self.gpus = [healthy_gpu() for _ in range(count)]
        # Each GPU's device "structure": a buffer whose address the handles point at.
        self._buffers = [ctypes.create_string_buffer(16) for _ in range(count)]
        self.registered: list[tuple[int, int]] = []  # (gpu, event types)
        self.driver_loaded = True
        self.inits = 0
        self._events: dict[int, tuple[int, int]] = {}  # gpu -> (type, data): the last only
        self._cond = threading.Condition()

    # --- handles ------------------------------------------------------------------------

    def handle(self, index: int) -> Any:
        """A new pointer object to GPU ``index``, as each pynvml call returns."""
        return ctypes.cast(self._buffers[index], pynvml.c_nvmlDevice_t)

    def _gpu(self, handle: Any) -> dict[str, Any]:
        self._check()
        address = ctypes.cast(handle, ctypes.c_void_p).value
        for i, buf in enumerate(self._buffers):
            if ctypes.addressof(buf) == address:
                gpu = self.gpus[i]
                if gpu["lost"]:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
                return gpu
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _check(self) -> None:
        if not self.driver_loaded:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    def _supported(self, gpu: dict[str, Any]) -> None:
        if not gpu["supported"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    # --- what a test does ---------------------------------------------------------------

    def fire(self, index: int, xid: int | None = None, *, dbe: bool = False) -> None:
        """The driver reports an XID (or a double-bit ECC error) on GPU ``index``."""
        kind = pynvml.nvmlEventTypeDoubleBitEccError if dbe else pynvml.nvmlEventTypeXidCriticalError
        with self._cond:
            self._events[index] = (kind, 0 if dbe else int(xid or 0))
            self._cond.notify_all()

    # --- pynvml's functions -------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._check()
        self.inits += 1

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.95.05"

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        self._check()
        return self.handle(i)

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        self._gpu(h)
        address = ctypes.cast(h, ctypes.c_void_p).value
        index = next(i for i, b in enumerate(self._buffers) if ctypes.addressof(b) == address)
        return f"GPU-{index:08x}-0000-0000-0000-fakefakefake"

    def nvmlDeviceGetName(self, h: Any) -> str:
        self._gpu(h)
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        self._gpu(h)
        address = ctypes.cast(h, ctypes.c_void_p).value
        index = next(i for i, b in enumerate(self._buffers) if ctypes.addressof(b) == address)
        return SimpleNamespace(busId=f"00000000:{0x18 + index * 0x10:02X}:00.0")

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        return SimpleNamespace(gpu=self._gpu(h)["util"], memory=0)

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return int(self._gpu(h)["temp"])

    def nvmlDeviceGetFieldValues(self, h: Any, field_ids: list[int]) -> Any:
        gpu = self._gpu(h)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, field_id in zip(values, field_ids, strict=True):
            value.fieldId = field_id
            if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP and gpu["supported"]:
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = int(gpu["memory_temp"])
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return int(self._gpu(h)["power"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return int(self._gpu(h)["clocks"])

    def nvmlDeviceGetTotalEccErrors(self, h: Any, kind: int, counter: int) -> int:
        gpu = self._gpu(h)
        self._supported(gpu)
        return int(gpu["dbe"] if kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else gpu["sbe"])

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(h)
        self._supported(gpu)
        return tuple(gpu["remap"])  # type: ignore[return-value]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: Any) -> int:
        return int(self._gpu(h)["pcie_gen"])

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: Any) -> int:
        return int(self._gpu(h)["pcie_width"])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: Any) -> int:
        return int(self._gpu(h)["pcie_max_gen"])

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: Any) -> int:
        return int(self._gpu(h)["pcie_max_width"])

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        return int(self._gpu(h)["replay"])

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        gpu = self._gpu(h)
        if link >= len(gpu["nvlink"]):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(gpu["nvlink"][link])

    def nvmlDeviceGetNvLinkErrorCounter(self, h: Any, link: int, counter: int) -> int:
        gpu = self._gpu(h)
        # The replay errors a test sets are on link 0.
        return int(gpu["nvlink_errors"]) if (link, counter) == (0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY) else 0

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        self._gpu(h)
        return int(pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError)

    def nvmlEventSetCreate(self) -> Any:
        return ctypes.c_void_p(0xE5E7)

    def nvmlEventSetFree(self, events: Any) -> None:
        pass

    def nvmlDeviceRegisterEvents(self, h: Any, types: int, events: Any) -> None:
        self._gpu(h)
        address = ctypes.cast(h, ctypes.c_void_p).value
        index = next(i for i, b in enumerate(self._buffers) if ctypes.addressof(b) == address)
        self.registered.append((index, types))

    def nvmlEventSetWait_v2(self, events: Any, timeout_ms: int) -> Any:
        with self._cond:
            if not self._events:
                self._cond.wait(timeout_ms / 1000)
            if not self._events:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            index, (kind, data) = next(iter(self._events.items()))
            del self._events[index]
        event = pynvml.c_nvmlEventData_t()
        event.device = self.handle(index)
        event.eventType = kind
        event.eventData = data
        event.gpuInstanceId = NO_INSTANCE
        event.computeInstanceId = NO_INSTANCE
        return event
