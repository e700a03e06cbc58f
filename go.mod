module github.com/ecmooncake/ecmooncake

go 1.26.8

require (
	github.com/pebbe/zmq4 v1.4.0
	github.com/stretchr/testify v1.12.1
	github.com/valyala/fasthttp v1.78.0
	go.uber.org/atomic v1.12.0
)

require (
	github.com/klauspost/compress v1.20.3 // indirect
	github.com/molecule-man/go-brrr v1.3.1 // indirect
	github.com/valyala/bytebufferpool v1.0.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)
