// Command etcd is the stock etcd server, built at the version that matches the
// etcd client linked into kube-apiserver.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
