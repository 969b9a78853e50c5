package nanoinfer

/*
#include <stdint.h>
#include <nanoinfer.h>

extern void nanoinferGoLog(ni_log_level, char *, void *);

static ni_status ni_go_set_log_callback(uintptr_t handle) {
	if (handle == 0) return ni_set_log_callback(NULL, NULL);
	return ni_set_log_callback((ni_log_callback)nanoinferGoLog, (void *)handle);
}
*/
import "C"

import (
	"runtime/cgo"
	"sync"
)

// LogLevel is a log message's severity; smaller is more severe.
type LogLevel int

const (
	LogError LogLevel = C.NI_LOG_ERROR
	LogWarn  LogLevel = C.NI_LOG_WARN
	LogInfo  LogLevel = C.NI_LOG_INFO
	LogDebug LogLevel = C.NI_LOG_DEBUG
)

var logMu sync.Mutex
var logHandle cgo.Handle

// SetLogger routes the library's log messages (model loads, session
// creation, recovered internal errors) to fn; nil drops them. fn may be
// called from several goroutines and from library threads at once. Once
// SetLogger returns, the previous logger is no longer called.
func SetLogger(fn func(level LogLevel, message string)) error {
	logMu.Lock()
	defer logMu.Unlock()
	var h cgo.Handle
	if fn != nil {
		h = cgo.NewHandle(fn)
	}
	err := call("ni_set_log_callback", func() C.ni_status { return C.ni_go_set_log_callback(C.uintptr_t(h)) })
	if err != nil {
		if h != 0 {
			h.Delete()
		}
		return err
	}
	if logHandle != 0 {
		logHandle.Delete()
	}
	logHandle = h
	return nil
}
