#!/bin/sh
# Render the ACL template (deploy/redis/users.acl) into a file Redis loads:
# comments and blank lines dropped, continued lines joined onto their `user`
# line, and each `#{password:NAME}` replaced by `#<SHA-256 of the password>`,
# the password read from the environment variable REDIS_PASSWORD_<NAME>
# (upper case, - as _). Prints to stdout; exits non-zero, naming the variable,
# when a password is missing.
#
#   REDIS_PASSWORD_WORKER=... [...] deploy/redis/render-acl.sh deploy/redis/users.acl > users.acl
#
# Passwords never appear on a command line: the shell's printf builtin feeds
# them to sha256sum on stdin. For a managed Redis that takes ACL SETUSER
# instead of a file: sed 's/^user /ACL SETUSER /' users.acl | redis-cli --user admin ...
set -eu

template=${1:-$(dirname "$0")/users.acl}
if [ ! -r "$template" ]; then
    echo "render-acl.sh: cannot read the template $template" >&2
    exit 2
fi

joined=$(awk '
    /^[[:space:]]*#/ || /^[[:space:]]*$/ { next }
    /^[[:space:]]/ { sub(/^[[:space:]]+/, ""); line = line " " $0; next }
    { if (line != "") print line; line = $0 }
    END { if (line != "") print line }
' "$template")

for name in $(printf '%s\n' "$joined" | grep -o '#{password:[A-Za-z0-9_-]*}' \
              | sed 's/^#{password:\(.*\)}$/\1/' | sort -u); do
    var=REDIS_PASSWORD_$(printf '%s' "$name" | tr 'a-z-' 'A-Z_')
    eval "value=\${$var:-}"
    if [ -z "$value" ]; then
        echo "render-acl.sh: $var is not set (the template's #{password:$name})" >&2
        exit 1
    fi
    hash=$(printf '%s' "$value" | sha256sum | cut -d ' ' -f 1)
    joined=$(printf '%s\n' "$joined" | sed "s/#{password:$name}/#$hash/g")
done

printf '%s\n' "$joined"
