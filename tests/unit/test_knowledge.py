"""The knowledge package's facts: the XID catalogue, causes and playbooks, step kinds."""

from __future__ import annotations

from collectors.knowledge import CAUSE_LABELS, PLAYBOOK_FOR, XID_TABLE, PlaybookName, RootCause
from collectors.knowledge.xid import GPU_OUT_XIDS, RECOVERY_FAULTS, Action, XidClass, takes_gpu_out, xid_info


def test_catalogue_covers_the_codes_fleetwatch_acts_on() -> None:
    # The XIDs the three old lists (collector health, simulator, repair check) agreed on, the
    # NVLink ones only the repair check knew, and the newer codes none of them had.
    old_lists = {48, 62, 63, 64, 74, 79, 94, 95, 119, 120, 140, 143}
    nvlink = {136, *range(144, 151)}
    newer = {155, 157, 158, 167, 169, 173}
    assert old_lists | nvlink | newer <= GPU_OUT_XIDS
    for code in newer:
        info = xid_info(code)
        assert info is not None and info.meaning and info.advice and takes_gpu_out(code)
        assert info.action in {Action.RESET_GPU, Action.RESTART_BM}
    # Application XIDs and XIDs that only inform never take the GPU out.
    assert not {13, 31, 43, 45, 68, 69, 92, 121, 154} & GPU_OUT_XIDS
    assert XID_TABLE[79].action == Action.RESTART_BM
    assert XID_TABLE[48].action == Action.WORKFLOW_XID_48


def test_causes_playbooks_and_model_choices_agree() -> None:
    from incidents.models import RootCause as ModelCause
    from incidents.remediation.playbooks import FOR_ROOT_CAUSE, PLAYBOOKS

    # The model's choices are exactly the causes with a playbook, with their labels.
    assert ModelCause.choices == [(c.value, CAUSE_LABELS[c]) for c in PLAYBOOK_FOR]
    assert {str(c): str(p) for c, p in PLAYBOOK_FOR.items()} == FOR_ROOT_CAUSE
    assert set(PLAYBOOKS) == {p.value for p in PlaybookName}
    assert {c.value for c in RootCause} >= {
        "gpu_hardware", "gpu_memory", "nvlink", "network_flap", "switch_failure", "thermal",
        "node_unreachable", "application_error", "fail_slow"}


def test_every_step_kind_declares_its_phase_and_wait() -> None:
    from incidents.remediation.playbooks import PLAYBOOKS
    from incidents.remediation.steps import STEP_KINDS, phase_of

    used = {s.kind for p in PLAYBOOKS.values() for s in p.steps}
    assert used <= set(STEP_KINDS)
    # A reboot's time counts towards the repair (it used to land in no phase).
    assert phase_of("reboot_request") == phase_of("reboot") == "replace"
    assert phase_of("notify") is None and phase_of("no_such_kind") is None
    assert STEP_KINDS["wait_cool"].longest_wait == 24 * 3600.0
    assert STEP_KINDS["wait_node_back"].waits_for_node


def test_xid_classes_that_blame_the_gpu_are_root_causes() -> None:
    for info in XID_TABLE.values():
        if info.klass in (XidClass.GPU_HARDWARE, XidClass.GPU_MEMORY, XidClass.NVLINK):
            assert RootCause(info.klass) in PLAYBOOK_FOR
        # A GPU taken out is a GPU fault: never an application or consequence XID.
        if info.takes_gpu_out:
            assert info.klass in (XidClass.GPU_HARDWARE, XidClass.GPU_MEMORY, XidClass.NVLINK)
    assert set(RECOVERY_FAULTS.values()) == {XidClass.GPU_HARDWARE}
    assert not takes_gpu_out(0) and xid_info(999) is None
