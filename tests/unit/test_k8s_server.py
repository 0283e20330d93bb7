"""The Kubernetes test server's own semantics, without HTTP: patches, selectors, paging,
PodDisruptionBudget arithmetic (kubectl checks the rest in tests/integration)."""

from __future__ import annotations

import importlib
import json
import time
from types import ModuleType

import pytest


def _server() -> ModuleType:
    """The test server's module (tests.harness.k8s_server: one module, one ApiError class)."""
    return importlib.import_module("tests.harness.k8s_server")


def test_strategic_merge_patch_merges_conditions_by_type_and_null_deletes() -> None:
    ks = _server()
    node = {"metadata": {"annotations": {"a": "1", "b": "2"}},
            "spec": {"unschedulable": True},
            "status": {"conditions": [{"type": "Ready", "status": "True"},
                                      {"type": "DiskPressure", "status": "False"}]}}
    patched = ks.strategic_merge_patch(node, {
        "metadata": {"annotations": {"a": None}}, "spec": {"unschedulable": None},
        "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}})
    assert patched["metadata"]["annotations"] == {"b": "2"}
    assert patched["spec"] == {}
    assert patched["status"]["conditions"] == [{"type": "Ready", "status": "Unknown"},
                                               {"type": "DiskPressure", "status": "False"}]
    # A merge patch replaces lists whole.
    merged = ks.merge_patch(node, {"status": {"conditions": [{"type": "Ready"}]}})
    assert merged["status"]["conditions"] == [{"type": "Ready"}]
    assert ks.json_patch(node, [{"op": "replace", "path": "/spec/unschedulable",
                                 "value": False}])["spec"]["unschedulable"] is False


def test_label_selectors() -> None:
    ks = _server()
    match = ks.label_selector("app in (trainer,api),tier!=db,!legacy")
    assert match({"app": "api", "tier": "web"})
    assert not match({"app": "api", "tier": "db"})
    assert not match({"app": "api", "legacy": "y"})
    assert not match({"app": "web"})
    assert ks.selector_object_matches({}, {"x": "y"})
    assert not ks.selector_object_matches(None, {"x": "y"})


def test_pdb_arithmetic_and_eviction_verdicts() -> None:
    ks = _server()
    server = ks.K8sTestServer({
        "nodes": [{"name": "n1"}],
        "pods": [{"namespace": "t", "name": f"p{i}", "node": "n1", "labels": {"app": "x"},
                  "ready": i < 3, "owner": {"kind": "ReplicaSet", "name": "x-1"}} for i in range(4)],
        "poddisruptionbudgets": [{"namespace": "t", "name": "x", "selector": {"app": "x"},
                                  "maxUnavailable": "50%"}]})
    pdb = server.get("poddisruptionbudgets", "t", "x")
    status = server.pdb_status(pdb)
    assert (status["expectedPods"], status["currentHealthy"], status["desiredHealthy"],
            status["disruptionsAllowed"]) == (4, 3, 2, 1)
    server.evict("t", "p0", {}, dry_run=False)
    with pytest.raises(ks.ApiError) as blocked:
        server.evict("t", "p1", {}, dry_run=False)
    assert blocked.value.code == 429 and blocked.value.reason == "TooManyRequests"
    # An unready pod may go while the budget is met by the others.
    server.evict("t", "p3", {}, dry_run=False)


def test_paging_and_an_expired_continue_token() -> None:
    ks = _server()
    server = ks.K8sTestServer({"nodes": [{"name": f"n{i}"} for i in range(5)]})
    nodes = next(r for r in ks.RESOURCES if r.plural == "nodes")
    first = server.list(nodes, None, {"limit": "2"})
    assert [n["metadata"]["name"] for n in first["items"]] == ["n0", "n1"]
    assert first["metadata"]["remainingItemCount"] == 3
    second = server.list(nodes, None, {"limit": "2", "continue": first["metadata"]["continue"]})
    assert [n["metadata"]["name"] for n in second["items"]] == ["n2", "n3"]
    server.set_node_ready("n0", False)
    server.compact()
    with pytest.raises(ks.ApiError) as gone:
        server.list(nodes, None, {"limit": "2", "continue": second["metadata"]["continue"]})
    assert gone.value.code == 410
    with pytest.raises(ks.ApiError) as unsupported:
        server.list(nodes, None, {"fieldSelector": "status.phase=Running"})
    assert unsupported.value.code == 400


# --- the API server's own checks (tests/harness/k8s_rules.py) ----------------------------------

QNAME_RULE = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must "
              "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
              "'123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?"
              "[A-Za-z0-9]')")


@pytest.mark.parametrize(("selector", "message"), [
    ("a in (b", "unable to parse requirement: found '', expected: ',' or ')'"),
    ("a b", "unable to parse requirement: found 'b', expected: in, notin, =, ==, !=, gt, lt"),
    ("x in (a b)", "unable to parse requirement: found 'b', expected: ',' or ')'"),
    ("a in b", "unable to parse requirement: found 'b' expected: '('"),
    ("a=b=c", "found '=', expected: ',' or 'end of string'"),
    ("a,", "found '', expected: identifier after ','"),
    ("=a", "found '=', expected: !, identifier, or 'end of string'"),
    ("app:monolith", f'unable to parse requirement: <nil>: Invalid value: "app:monolith": '
                     f"{QNAME_RULE}"),
    ("a=-x", 'unable to parse requirement: values[0][a]: Invalid value: "-x": a valid label '
             "must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
             "and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
             "'my_value',  or '12345', regex used for validation is "
             "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"),
    ("a>x", "unable to parse requirement: values[0]: Invalid value: \"x\": for 'Gt', 'Lt' "
            "operators, the value must be an integer"),
])
def test_malformed_label_selectors_fail_with_the_apiservers_words(selector: str,
                                                                  message: str) -> None:
    ks = _server()
    with pytest.raises(ks.SelectorError) as bad:
        ks.label_selector(selector)
    assert str(bad.value) == message
    # Through the server: a 400 BadRequest Status with the same message.
    server = ks.K8sTestServer({"nodes": [{"name": "n1"}]})
    nodes = next(r for r in ks.RESOURCES if r.plural == "nodes")
    with pytest.raises(ks.ApiError) as refused:
        server.list(nodes, None, {"labelSelector": selector})
    status = refused.value.status()
    assert (status["code"], status["reason"], status["message"]) == (400, "BadRequest", message)


def test_label_selector_grammar_matches_as_upstream() -> None:
    ks = _server()
    match = ks.label_selector("x in (foo,,baz),y,z notin ()")
    assert match({"x": "", "y": "1"}) and match({"x": "baz", "y": "", "z": "q"})
    assert not match({"x": "bar", "y": "1"}) and not match({"x": "foo"})
    assert not match({"x": "foo", "y": "1", "z": ""})
    assert ks.label_selector("gen>5,!legacy")({"gen": "6"})
    assert not ks.label_selector("gen>5")({"gen": "5"})
    assert not ks.label_selector("gen<5")({"gen": "four"})
    assert ks.label_selector("a==b, c!=d")({"a": "b"})
    assert ks.label_selector("")({"anything": "x"})


def test_field_selectors_parse_and_check_fields_as_upstream() -> None:
    ks = _server()
    rules = ks.k8s_rules
    assert rules.parse_field_selector(r"metadata.name=a\,b,spec.nodeName!=x") == [
        ("metadata.name", "=", "a,b"), ("spec.nodeName", "!=", "x")]
    for text, message in [
        ("spec.nodeName", "invalid selector: 'spec.nodeName'; can't understand 'spec.nodeName'"),
        ("metadata.name=a=b", "invalid field selector: unescaped character in value: 61"),
        (r"metadata.name=a\x", r"invalid field selector: invalid escape sequence: \x"),
    ]:
        with pytest.raises(rules.SelectorError) as bad:
            rules.parse_field_selector(text)
        assert str(bad.value) == message
    server = ks.K8sTestServer({"nodes": [{"name": "n1"}]})
    by_plural = {r.plural: r for r in ks.RESOURCES if not r.group or r.group == "policy"}
    with pytest.raises(ks.ApiError) as nodes:
        server.list(by_plural["nodes"], None, {"fieldSelector": "metadata.name=n1,status.x=y"})
    assert nodes.value.code == 400 and nodes.value.message == "field label not supported: status.x"
    with pytest.raises(ks.ApiError) as pdbs:
        server.list(by_plural["poddisruptionbudgets"], None, {"fieldSelector": "spec.x=1"})
    assert pdbs.value.message == ('"spec.x" is not a known field selector: only '
                                  '"metadata.name", "metadata.namespace"')


def test_invalid_objects_get_422_with_one_cause_per_field() -> None:
    rules = _server().k8s_rules
    node = {"metadata": {"name": "Gpu_1", "labels": {"ok/k": "v", "bad key": "-v"}},
            "spec": {"taints": [{"key": "gpu", "effect": "Bogus"}, {"key": "gpu", "value": "x",
                                                                  "effect": "NoSchedule"},
                                {"key": "gpu", "effect": "NoSchedule"}]}}
    errors = rules.validate("nodes", node)
    assert [(e.type, e.field) for e in errors] == [
        ("FieldValueInvalid", "metadata.name"), ("FieldValueInvalid", "metadata.labels"),
        ("FieldValueInvalid", "metadata.labels"), ("FieldValueNotSupported",
                                                   "spec.taints[0].effect"),
        ("FieldValueInvalid", "spec.taints[2]")]
    status = rules.invalid_object("Node", "", "Gpu_1", errors).status()
    assert (status["code"], status["reason"]) == (422, "Invalid")
    assert status["message"].startswith('Node "Gpu_1" is invalid: [metadata.name: Invalid value: '
                                        '"Gpu_1": a lowercase RFC 1123 subdomain must consist')
    assert status["details"]["name"] == "Gpu_1" and status["details"]["kind"] == "Node"
    assert status["details"]["causes"][3] == {
        "reason": "FieldValueNotSupported", "field": "spec.taints[0].effect",
        "message": 'Unsupported value: "Bogus": supported values: "NoSchedule", '
                   '"PreferNoSchedule", "NoExecute"'}
    assert status["details"]["causes"][1]["message"] == f'Invalid value: "bad key": {QNAME_RULE}'
    assert rules.validate("namespaces", {"metadata": {"name": "a.b"}})[0].detail == (
        "must not contain dots")
    assert [str(e) for e in rules.validate("pods", {"metadata": {"name": "p"}, "spec": {}})] == [
        "spec.containers: Required value"]
    assert rules.decode_error("nodes", {"spec": {"unschedulable": "yes"}}) == (
        "json: cannot unmarshal string into Go struct field NodeSpec.spec.unschedulable of type "
        "bool")
    assert rules.decode_error("pods", {"metadata": {"labels": {"rack": 7}}}) == (
        "json: cannot unmarshal number into Go struct field ObjectMeta.metadata.labels of type "
        "string")
    assert rules.decode_error("nodes", {"spec": {"unschedulable": True}}) is None


def test_objects_carry_what_a_kubelet_and_go_always_write() -> None:
    ks = _server()
    server = ks.K8sTestServer({"nodes": [{"name": "n1"}, {"metadata": {"name": "bare"}}],
                               "pods": [{"namespace": "t", "name": "p", "node": "n1"}]})
    nodes = next(r for r in ks.RESOURCES if r.plural == "nodes")
    info = server.out(nodes, server.get("nodes", "", "n1"))["status"]["nodeInfo"]
    assert set(info) == set(ks.k8s_rules.NODE_INFO_FIELDS) and all(info.values())
    bare = server.out(nodes, server.get("nodes", "", "bare"))["status"]
    assert bare["nodeInfo"]["bootID"] == "" and bare["daemonEndpoints"]["kubeletEndpoint"] == {
        "Port": 0}
    pods = next(r for r in ks.RESOURCES if r.plural == "pods")
    cs = server.out(pods, server.get("pods", "t", "p"))["status"]["containerStatuses"][0]
    assert cs["imageID"].startswith("registry.local/train@sha256:")
    assert cs["containerID"].startswith("containerd://") and cs["image"]


def test_a_bad_limit_is_a_400_not_a_crash() -> None:
    ks = _server()
    server = ks.K8sTestServer({"nodes": [{"name": "n1"}]})
    nodes = next(r for r in ks.RESOURCES if r.plural == "nodes")
    with pytest.raises(ks.ApiError) as bad:
        server.list(nodes, None, {"limit": "ten"})
    assert (bad.value.code, bad.value.message) == (
        400, 'strconv.ParseInt: parsing "ten": invalid syntax')


# --- batch/v1 Jobs and the workloads stand-in (tests/harness/k8s_workloads.py) -----------------


def _job(name: str, script: str = "true", **spec: object) -> dict[str, object]:
    return {"metadata": {"name": name}, "spec": {**spec, "template": {"spec": {
        "restartPolicy": "Never", "containers": [{"name": "check", "image": "busybox",
                                                  "command": ["sh", "-c", script]}]}}}}


def test_a_new_job_gets_the_api_servers_defaults_and_discovery_lists_jobs() -> None:
    ks = _server()
    server = ks.K8sTestServer()
    jobs = ks.find_resource("batch", "v1", "jobs")
    job = server.create("jobs", _job("accept"), "default", validate_as=jobs)
    uid, spec = job["metadata"]["uid"], job["spec"]
    assert spec["selector"] == {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    assert spec["template"]["metadata"]["labels"] == {
        "batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
        "batch.kubernetes.io/job-name": "accept", "job-name": "accept"}
    assert (spec["parallelism"], spec["completions"], spec["backoffLimit"],
            spec["completionMode"], spec["suspend"], spec["podReplacementPolicy"]) == (
        1, 1, 6, "NonIndexed", False, "TerminatingOrFailed")
    manual = server.create("jobs", {**_job("manual"), "spec": {
        **_job("manual")["spec"], "manualSelector": True, "selector": {"matchLabels": {"a": "b"}},
        "parallelism": 2}}, "default", validate_as=jobs)
    assert manual["spec"]["selector"] == {"matchLabels": {"a": "b"}}
    assert "completions" not in manual["spec"]  # a work queue: parallelism alone
    entry = next(e for e in ks.resource_list("batch", "v1")["resources"] if e["name"] == "jobs")
    assert (entry["kind"], entry["namespaced"], entry["categories"]) == ("Job", True, ["all"])
    assert "shortNames" not in entry
    assert {"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod",
            "verbs": ["get"]} in ks.resource_list("", "v1")["resources"]
    assert "batch" in ks.GROUPS


def test_an_invalid_job_is_a_422_in_the_api_servers_words() -> None:
    ks = _server()
    server = ks.K8sTestServer()
    jobs = ks.find_resource("batch", "v1", "jobs")
    bad = _job("x" * 64, backoffLimit=-1)
    bad["spec"]["template"]["spec"]["restartPolicy"] = "Always"  # type: ignore[index]
    bad["spec"]["template"]["spec"]["containers"][0]["image"] = ""  # type: ignore[index]
    with pytest.raises(ks.ApiError) as refused:
        server.create("jobs", bad, "default", validate_as=jobs)
    status = refused.value.status()
    assert (status["code"], status["reason"], status["details"]["kind"],
            status["details"]["group"]) == (422, "Invalid", "Job", "batch")
    assert [(c["field"], c["message"]) for c in status["details"]["causes"]] == [
        ("spec.backoffLimit", "Invalid value: -1: must be greater than or equal to 0"),
        ("spec.template.labels", f'Invalid value: "{"x" * 64}": must be no more than 63 '
                                 "characters"),
        ("spec.template.labels", f'Invalid value: "{"x" * 64}": must be no more than 63 '
                                 "characters"),
        ("spec.template.spec.containers[0].image", "Required value"),
        ("spec.template.spec.restartPolicy",
         'Unsupported value: "Always": supported values: "OnFailure", "Never"')]
    assert status["message"].startswith(f'Job.batch "{"x" * 64}" is invalid: [')
    # restartPolicy left out defaults to Always, which a Job refuses.
    plain = _job("plain")
    del plain["spec"]["template"]["spec"]["restartPolicy"]  # type: ignore[index]
    with pytest.raises(ks.ApiError) as defaulted:
        server.create("jobs", plain, "default", validate_as=jobs)
    assert "spec.template.spec.restartPolicy: Unsupported value: \"Always\"" in (
        defaulted.value.message)
    assert server.create("jobs", _job("x" * 63), "default", validate_as=jobs)


def test_toleration_matching_and_the_schedulers_verdicts() -> None:
    wl = _server().k8s_workloads
    taint = {"key": "gpu", "value": "bad", "effect": "NoSchedule"}
    assert wl.tolerates({"key": "gpu", "operator": "Equal", "value": "bad",
                         "effect": "NoSchedule"}, taint)
    assert wl.tolerates({"key": "gpu", "value": "bad"}, taint)  # no operator: Equal; any effect
    assert not wl.tolerates({"key": "gpu", "value": "good"}, taint)
    assert wl.tolerates({"key": "gpu", "operator": "Exists"}, taint)
    assert wl.tolerates({"operator": "Exists"}, taint)  # empty key + Exists: everything
    assert not wl.tolerates({"key": "gpu", "operator": "Exists", "effect": "NoExecute"}, taint)
    assert not wl.tolerates({"key": "other", "operator": "Exists"}, taint)

    def node(name: str, **spec: object) -> dict[str, object]:
        return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                "spec": spec, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}

    nodes = [node("a", taints=[taint, {"key": "soft", "effect": "PreferNoSchedule"}]),
             node("b", unschedulable=True), node("c")]
    pinned = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                "values": ["a"]}]}]}}}}
    assert wl.schedule(pinned, nodes) == (None, (
        "0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 1 node(s) "
        "had untolerated taint {gpu: bad}, 1 node(s) were unschedulable. preemption: 0/3 nodes "
        "are available: 3 Preemption is not helpful for scheduling."))
    assert wl.schedule({**pinned, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
                       nodes) == ("a", "")
    by_selector = {"nodeSelector": {"kubernetes.io/hostname": "b"}}
    assert wl.schedule(by_selector, nodes)[0] is None
    assert wl.schedule({**by_selector, "tolerations": [
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists",
         "effect": "NoSchedule"}]}, nodes) == ("b", "")
    not_ready = node("d")
    not_ready["status"] = {"conditions": [{"type": "Ready", "status": "False"}]}
    assert wl.schedule({"nodeName": None}, [not_ready])[1].startswith(
        "0/1 nodes are available: 1 node(s) had untolerated taint "
        "{node.kubernetes.io/not-ready: }.")
    assert wl.schedule({}, []) == (None, "no nodes available to schedule pods")


def test_jobs_run_and_logs_read_through_the_official_client(tmp_path: object) -> None:
    from pathlib import Path

    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    ks = _server()
    server = ks.K8sTestServer({"nodes": [{"name": "gpu-001"}]}, run_pods=True,
                              kubeconfig_path=Path(str(tmp_path)) / "kubeconfig")
    server.start()
    try:
        api = config.new_client_from_config(config_file=str(server.kubeconfig_path))
        batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
        job = client.V1Job(
            metadata=client.V1ObjectMeta(name="accept"),
            spec=client.V1JobSpec(backoff_limit=0, template=client.V1PodTemplateSpec(
                spec=client.V1PodSpec(restart_policy="Never", node_name="gpu-001", containers=[
                    client.V1Container(name="check", image="busybox", command=["sh", "-c"],
                                       args=["echo one; echo two; echo $GREETING $HOSTNAME"],
                                       env=[client.V1EnvVar(name="GREETING",
                                                            value="hello")])]))))
        created = batch.create_namespaced_job("default", job)
        assert created.spec.backoff_limit == 0 and created.spec.completions == 1

        def finished() -> object:
            status = batch.read_namespaced_job("accept", "default").status
            return next((c for c in status.conditions or [] if c.type == "Complete"), None)

        deadline = time.monotonic() + 30
        while not finished():
            assert time.monotonic() < deadline, "the job did not complete"
            time.sleep(0.1)
        pods = core.list_namespaced_pod("default", label_selector="job-name=accept").items
        assert len(pods) == 1
        pod = pods[0].metadata.name
        assert pods[0].status.container_statuses[0].state.terminated.exit_code == 0
        assert core.read_namespaced_pod_log(pod, "default") == f"one\ntwo\nhello {pod}\n"
        assert core.read_namespaced_pod_log(pod, "default", tail_lines=1) == f"hello {pod}\n"
        assert core.read_namespaced_pod_log(pod, "default", limit_bytes=5) == "one\nt"
        with pytest.raises(ApiException) as wrong:
            core.read_namespaced_pod_log(pod, "default", container="nope")
        assert wrong.value.status == 400
        assert json.loads(wrong.value.body)["message"] == (
            f"container nope is not valid for pod {pod}")

        # No propagationPolicy: batch/v1 orphans the pods; Background deletes them.
        batch.delete_namespaced_job("accept", "default")
        orphan = core.read_namespaced_pod(pod, "default")
        assert orphan.metadata.owner_references is None
        batch.create_namespaced_job("default", client.V1Job(
            metadata=client.V1ObjectMeta(name="sleeper"), spec=client.V1JobSpec(
                template=client.V1PodTemplateSpec(spec=client.V1PodSpec(
                    restart_policy="Never", containers=[client.V1Container(
                        name="check", image="busybox", command=["sleep", "60"])])))))
        deadline = time.monotonic() + 30
        while not batch.read_namespaced_job("sleeper", "default").status.ready:
            assert time.monotonic() < deadline, "the job's pod did not get ready"
            time.sleep(0.1)
        batch.delete_namespaced_job("sleeper", "default", propagation_policy="Background")
        assert core.list_namespaced_pod("default", label_selector="job-name=sleeper").items == []
        assert not server.workloads.running  # its process was killed
    finally:
        server.stop()


def test_the_log_of_a_pod_that_has_not_started() -> None:
    ks = _server()
    server = ks.K8sTestServer({"nodes": [{"name": "n1"}],
                               "pods": [{"namespace": "t", "name": "seeded", "node": "n1"}]},
                              run_pods=True)
    assert server.workloads.read_log(server.get("pods", "t", "seeded"), {}) == ""
    jobs = ks.find_resource("batch", "v1", "jobs")
    job = server.create("jobs", _job("p"), "default", validate_as=jobs)
    pod = {"metadata": {"name": "p", "namespace": "default", "uid": "u1", "ownerReferences": [
        {"kind": "Job", "name": "p", "uid": job["metadata"]["uid"], "controller": True}]},
        "spec": {"nodeName": "n1", "containers": [{"name": "check", "image": "b"}]},
        "status": {"phase": "Pending"}}
    with pytest.raises(ks.ApiError) as waiting:
        server.workloads.read_log(pod, {})
    assert (waiting.value.code, waiting.value.message) == (
        400, 'container "check" in pod "p" is waiting to start: ContainerCreating')
    unscheduled = {**pod, "spec": {"containers": pod["spec"]["containers"]}}
    assert server.workloads.read_log(unscheduled, {}) == ""  # no node to ask: nothing


def test_restarts_start_errors_and_ttl_without_http() -> None:
    ks = _server()
    server = ks.K8sTestServer({"nodes": [{"name": "n1"}]}, run_pods=True)
    jobs = ks.find_resource("batch", "v1", "jobs")
    flaky = _job("flaky", "test -e marker || { touch marker; exit 1; }", backoffLimit=2)
    flaky["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"  # type: ignore[index]
    server.create("jobs", flaky, "default", validate_as=jobs)
    server.create("jobs", {**_job("nocmd", backoffLimit=0)}, "default", validate_as=jobs)
    del server.objects["jobs"][("default", "nocmd")]["spec"]["template"]["spec"][
        "containers"][0]["command"]
    server.create("jobs", _job("brief", ttlSecondsAfterFinished=0), "default", validate_as=jobs)

    def conditions(name: str) -> set[str]:
        job = server.get("jobs", "default", name)
        return {c["type"] for c in ((job or {}).get("status") or {}).get("conditions") or []}

    def pods(name: str) -> list[dict[str, object]]:
        return [p for p in server.objects["pods"].values()
                if p["metadata"]["labels"].get("job-name") == name]

    server.workloads.start()
    try:
        deadline = time.monotonic() + 30
        while not ("Complete" in conditions("flaky") and "Failed" in conditions("nocmd")
                   and server.get("jobs", "default", "brief") is None):
            assert time.monotonic() < deadline, "the jobs did not finish"
            time.sleep(0.1)
        # OnFailure: the same pod, its container restarted once.
        [restarted] = pods("flaky")
        status = restarted["status"]["containerStatuses"][0]  # type: ignore[index]
        assert status["restartCount"] == 1
        assert status["lastState"]["terminated"]["exitCode"] == 1
        [never_ran] = pods("nocmd")
        term = never_ran["status"]["containerStatuses"][0]["state"]["terminated"]  # type: ignore[index]
        assert (term["reason"], term["exitCode"]) == ("StartError", 128)
        assert pods("brief") == []  # the TTL deleted the job and its pod
    finally:
        server.workloads.stop()
