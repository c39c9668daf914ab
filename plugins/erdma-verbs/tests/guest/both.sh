# One boot, both suites (both.sh PYTHON CHECKOUT, in the plugin's folder): the verbs tests of tests/guest, then
# the core's collective tests over verbs (collectives.sh). Each suite's output goes to .guest-<name>.out and its
# exit status to .guest-<name>.rc beside this run's own, so the host tells the two apart.
rm -f .guest-verbs.* .guest-collectives.*
"$1" -m pytest -q -p no:cacheprovider -p no:randomly --durations=5 tests/guest > .guest-verbs.out 2>&1
echo $? > .guest-verbs.rc
sh tests/guest/collectives.sh "$1" "$2" > .guest-collectives.out 2>&1
echo $? > .guest-collectives.rc
