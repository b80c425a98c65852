// kstatus reads a JSON array of Kubernetes objects on stdin and prints, for each, the
// status that sigs.k8s.io/cli-utils' kstatus computes for it (the library Flux, kpt and
// Argo CD's gitops-engine tooling use), as a JSON array of {status, message}.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	var objs []map[string]interface{}
	data, err := io.ReadAll(os.Stdin)
	if err == nil {
		// Kubernetes' decoder: integers stay int64, as kstatus expects.
		err = utiljson.Unmarshal(data, &objs)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kstatus: reading stdin:", err)
		os.Exit(2)
	}
	out := make([]verdict, 0, len(objs))
	for _, obj := range objs {
		res, err := status.Compute(&unstructured.Unstructured{Object: obj})
		if err != nil {
			fmt.Fprintln(os.Stderr, "kstatus:", err)
			os.Exit(1)
		}
		out = append(out, verdict{Status: res.Status.String(), Message: res.Message})
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(1)
	}
}
