#!/bin/sh
# The Claude Code CLI under strace: every connect() of it and its children goes to
# $PROXY_NET_LOG.strace, which the test reads (the Python audit hook cannot see a native binary).
exec strace -f -qq -e trace=connect -o "$PROXY_NET_LOG.strace" "$CLAUDE_CLI" "$@"
