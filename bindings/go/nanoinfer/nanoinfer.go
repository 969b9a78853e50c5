// Package nanoinfer is the Go binding of NanoInfer, an embeddable LLM
// inference engine, over its C ABI (nanoinfer.h).
//
// Load a [Model], open a [Session] on it, and either drive generation
// yourself ([Session.AddRequest], [Session.Step]) or stream one request with
// [Session.Generate]. Every type with a Close method owns native memory;
// call Close when done (a cleanup frees forgotten objects, but late).
//
// Building needs the installed library: cgo finds it with pkg-config
// (PKG_CONFIG_PATH=<prefix>/lib/pkgconfig), and the program needs
// libnanoinfer.so at run time (LD_LIBRARY_PATH or an rpath).
package nanoinfer

/*
#cgo pkg-config: nanoinfer
#include <stdlib.h>
#include <nanoinfer.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
)

// Version is the library version, e.g. "0.1.0".
func Version() string { return C.GoString(C.ni_version()) }

// ABIVersion is the C ABI version of the loaded library.
func ABIVersion() uint32 { return uint32(C.ni_abi_version()) }

// HeaderABIVersion is the C ABI version this package was compiled against.
const HeaderABIVersion = uint32(C.NI_ABI_VERSION)

// Status is the library's ni_status code of a failed call.
type Status int

const (
	StatusInvalidArgument Status = C.NI_ERR_INVALID_ARGUMENT
	StatusIO              Status = C.NI_ERR_IO
	StatusInvalidModel    Status = C.NI_ERR_INVALID_MODEL
	StatusUnsupported     Status = C.NI_ERR_UNSUPPORTED
	StatusOutOfMemory     Status = C.NI_ERR_OUT_OF_MEMORY
	StatusCancelled       Status = C.NI_ERR_CANCELLED
	StatusBusy            Status = C.NI_ERR_BUSY
	StatusInternal        Status = C.NI_ERR_INTERNAL
	StatusPanic           Status = C.NI_ERR_PANIC
)

// String is the C constant's name, e.g. "NI_ERR_IO".
func (s Status) String() string { return C.GoString(C.ni_status_name(C.ni_status(s))) }

// Error is a failed library call: its status and the library's message.
// Compare with errors.Is against the Err* sentinels.
type Error struct {
	Status  Status
	Op      string // the C function, e.g. "ni_model_load"
	Message string // ni_last_error() of the call
}

func (e *Error) Error() string {
	if e.Op == "" {
		return "nanoinfer: " + e.Message
	}
	return fmt.Sprintf("nanoinfer: %s: %s", e.Op, e.Message)
}

// Is reports whether target is a sentinel with the same status.
func (e *Error) Is(target error) bool {
	var t *Error
	return errors.As(target, &t) && t.Op == "" && t.Message == "" && t.Status == e.Status
}

// Sentinels for errors.Is.
var (
	ErrInvalidArgument = &Error{Status: StatusInvalidArgument}
	ErrIO              = &Error{Status: StatusIO}
	ErrInvalidModel    = &Error{Status: StatusInvalidModel}
	ErrUnsupported     = &Error{Status: StatusUnsupported}
	ErrOutOfMemory     = &Error{Status: StatusOutOfMemory}
	ErrCancelled       = &Error{Status: StatusCancelled}
	ErrBusy            = &Error{Status: StatusBusy}
	ErrInternal        = &Error{Status: StatusInternal}
	ErrPanic           = &Error{Status: StatusPanic}
	// ErrClosed is returned by methods of a closed Model or Session.
	ErrClosed = errors.New("nanoinfer: use of a closed object")
)

// call runs one fallible C call. The goroutine stays on its OS thread so
// that ni_last_error (thread-local) belongs to this call.
func call(op string, f func() C.ni_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st := f()
	if st == C.NI_OK {
		return nil
	}
	return &Error{Status: Status(st), Op: op, Message: C.GoString(C.ni_last_error())}
}
