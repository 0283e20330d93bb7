#!/bin/sh
# An example FleetWatch node provider program (FLEETWATCH_PROVIDER=command).
#
#   FLEETWATCH_PROVIDER=command
#   FLEETWATCH_PROVIDER_COMMAND="/opt/site/example-provider.sh --zone us-east5-a"
#   FLEETWATCH_PROVIDER_TIMEOUT=600
#
# FleetWatch runs it without a shell as  <command> <action> <node> [args...]  where <command>
# is FLEETWATCH_PROVIDER_COMMAND split like a shell would (so options can be put there), and
# records the exact argv, its exit status, stdout and stderr in the audit trail.
#
#   replace NODE             start replacing NODE; print {"new_node": "...", "ready": false,
#                            "detail": "..."} (new_node may be "" while unknown)
#   replacement-status NODE  print the same object for a replacement under way, or nothing /
#                            null when none is known
#   reboot NODE REASON       reboot NODE; REASON starts with "fleetwatch:"
#   reset-gpu NODE GPU       reset GPU (an index, or "all") on NODE
#   status NODE              print {"state": "...", "detail": "..."}; state is one of ready,
#                            provisioning, rebooting, resetting, replaced, failed, unknown
#
# reboot and reset-gpu print one line for the audit trail, or {"changed": false, "detail":
# "..."} when there was nothing to do (asked again while already under way).
#
# Exit status: 0 success; 2 a permanent failure (an unknown node, an action this site does not
# support: FleetWatch stops and asks a person); anything else, or running past
# FLEETWATCH_PROVIDER_TIMEOUT (the whole process group is killed), is transient and retried
# with backoff. Every action must be idempotent: a retried step runs it again.
#
# This example keeps its state in files under $EXAMPLE_PROVIDER_STATE and "provisions" a spare
# in EXAMPLE_PROVIDER_SECONDS; the comments show what a site would call instead.

set -eu

state_dir=${EXAMPLE_PROVIDER_STATE:-/tmp/fleetwatch-example-provider}
provision_seconds=${EXAMPLE_PROVIDER_SECONDS:-60}

# Options before the action (from FLEETWATCH_PROVIDER_COMMAND) are the site's own.
while [ $# -gt 0 ]; do
    case $1 in
        --zone) zone=$2; shift 2 ;;
        --*) echo "unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
: "${zone:=example-zone}"

[ $# -ge 2 ] || { echo "usage: $0 [--zone Z] ACTION NODE [ARGS...]" >&2; exit 2; }
action=$1 node=$2
shift 2

case $node in
    *[!A-Za-z0-9._-]*|'') echo "invalid node name: $node" >&2; exit 2 ;;
esac
mkdir -p "$state_dir"
record="$state_dir/replace-$node"

json_escape() {
    printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g'
}

replacement() {
    new=$(sed -n 1p "$record")
    started=$(sed -n 2p "$record")
    now=$(date +%s)
    where=$(json_escape "$zone")
    if [ $((now - started)) -ge "$provision_seconds" ]; then
        printf '{"new_node": "%s", "ready": true, "detail": "%s is up in %s"}\n' \
            "$new" "$new" "$where"
    else
        printf '{"new_node": "%s", "ready": false, "detail": "%s provisioning in %s (%ss)"}\n' \
            "$new" "$new" "$where" $((now - started))
    fi
}

case $action in
    replace)
        if [ ! -f "$record" ]; then
            # A site would ask its cloud here, e.g.
            #   gcloud compute instance-groups managed delete-instances gpu-pool \
            #       --instances="$node" --zone="$zone"   # the group recreates one
            #   aws autoscaling terminate-instance-in-auto-scaling-group \
            #       --instance-id "$(lookup "$node")" --no-should-decrement-desired-capacity
            #   az vmss delete-instances -g rg -n gpu-pool --instance-ids "$(lookup "$node")"
            printf '%s-r\n%s\n' "$node" "$(date +%s)" > "$record.tmp"
            mv "$record.tmp" "$record"
        fi
        replacement
        ;;
    replacement-status)
        [ -f "$record" ] && replacement || echo null
        ;;
    reboot)
        [ $# -ge 1 ] || { echo "reboot needs a reason" >&2; exit 2; }
        reason=$1
        # e.g. ipmitool -I lanplus -H "$node-bmc" -U admin -E chassis power cycle
        #      (with "$reason" in the site's change log)
        if [ -f "$state_dir/reboot-$node" ]; then
            echo '{"changed": false, "detail": "reboot already under way"}'
        else
            printf '%s\n' "$reason" > "$state_dir/reboot-$node"
            echo "power cycle of $node requested ($reason)"
        fi
        ;;
    reset-gpu)
        [ $# -ge 1 ] || { echo "reset-gpu needs a GPU index or all" >&2; exit 2; }
        # e.g. ssh "$node" nvidia-smi --gpu-reset -i "$1"
        echo "GPU $1 of $node reset"
        ;;
    status)
        if [ -f "$record" ]; then
            printf '{"state": "replaced", "detail": "replaced by %s"}\n' "$(sed -n 1p "$record")"
        elif [ -f "$state_dir/reboot-$node" ]; then
            echo '{"state": "rebooting", "detail": "power cycle requested"}'
        else
            echo '{"state": "ready", "detail": "up"}'
        fi
        ;;
    *)
        echo "unknown action: $action" >&2
        exit 2
        ;;
esac
