// Command podsecurity evaluates one pod (JSON on stdin) against a Pod Security Standards
// level with the same library the API server's PodSecurity admission plugin runs
// (k8s.io/pod-security-admission), and prints {"allowed", "reasons", "details"} as JSON.
//
// Usage: podsecurity LEVEL [VERSION]   (LEVEL: privileged, baseline, restricted;
// VERSION: "latest" or "v1.N", default latest)
package main

import (
	"encoding/json"
	"fmt"
	"os"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
)

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 || len(os.Args) > 3 {
		fail("usage: podsecurity LEVEL [VERSION] < pod.json")
	}
	level, err := api.ParseLevel(os.Args[1])
	if err != nil {
		fail("level: %v", err)
	}
	versionText := "latest"
	if len(os.Args) == 3 {
		versionText = os.Args[2]
	}
	version, err := api.ParseVersion(versionText)
	if err != nil {
		fail("version: %v", err)
	}
	var pod corev1.Pod
	decoder := json.NewDecoder(os.Stdin)
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(&pod); err != nil {
		fail("pod: %v", err)
	}
	evaluator, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		fail("evaluator: %v", err)
	}
	results := evaluator.EvaluatePod(
		api.LevelVersion{Level: level, Version: version}, &pod.ObjectMeta, &pod.Spec,
	)
	verdict := policy.AggregateCheckResults(results)
	out := map[string]any{
		"allowed": verdict.Allowed,
		"reasons": verdict.ForbiddenReason(),
		"details": verdict.ForbiddenDetail(),
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail("output: %v", err)
	}
}
