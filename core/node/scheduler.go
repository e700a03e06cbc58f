package node

import (
	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/scheduler"
)

// OpenScheduler opens a consumer scheduler that follows the shards the
// settings name.
func OpenScheduler(cfg config.Scheduler, opt Options) (*scheduler.Scheduler, error) {
	return scheduler.Open(cfg, scheduler.Options{Log: opt.log(), Links: opt.links()})
}
