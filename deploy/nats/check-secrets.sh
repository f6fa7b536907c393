#!/bin/sh
# Refuse to start a server whose secrets are still the shipped placeholders.
#   check-secrets.sh                 check only (systemd ExecStartPre: a non-zero exit stops the start)
#   check-secrets.sh CMD [ARGS...]   check, then exec CMD (compose: the entrypoint in front of the server)
# Refused, naming the variable (never its value):
#   any variable whose value contains CHANGE-ME (deploy/env/*.env ship CHANGE-ME-<role>: a password
#   every reader of the repository knows; `asyncrl deploy init` replaces them all),
#   an empty *PASSWORD* / *NKEY* / *SEED* variable (an empty secret is no secret),
#   a leaf URL with credentials in it (ASYNCRL_NATS_HUB_LEAF_URL=nats-leaf://user:pw@...): the leaf
#   logs in with the region's nkey (ASYNCRL_NATS_REGION_SEED), nothing secret crosses the WAN.
# POSIX sh: runs in the nats:alpine image (busybox) and on any systemd host.
bad=0
for name in $(env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p'); do
    eval "value=\${$name}"
    case "$value" in
        *[Cc][Hh][Aa][Nn][Gg][Ee]-[Mm][Ee]*)
            echo "check-secrets: $name is still a CHANGE-ME placeholder: run \`asyncrl deploy init\`" \
                 "(docs/operations.md) or set a real secret" >&2
            bad=1 ;;
    esac
    case "$name" in
        *PASSWORD*|*NKEY*|*SEED*)
            if [ -z "$value" ]; then
                echo "check-secrets: $name is empty: an empty secret is no secret" >&2
                bad=1
            fi ;;
    esac
done
case "${ASYNCRL_NATS_HUB_LEAF_URL:-}" in
    *://*@*)
        echo "check-secrets: ASYNCRL_NATS_HUB_LEAF_URL carries credentials; the leaf logs in with the" \
             "region's nkey (ASYNCRL_NATS_REGION_SEED): give the URL without user:password@" >&2
        bad=1 ;;
esac
if [ "$bad" -ne 0 ]; then
    echo "check-secrets: refusing to start" >&2
    exit 78      # EX_CONFIG
fi
if [ "$#" -gt 0 ]; then
    exec "$@"
fi
exit 0
