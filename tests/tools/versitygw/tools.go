//go:build tools

// Package tools pins the Versity S3 Gateway, the real S3 server the S3 tests run
// against beside moto.
package tools

import _ "github.com/versity/versitygw/cmd/versitygw"
