// DSA-TRT TensorRT plugins: field parsing, logging, dtype and shape helpers (plugin_common.h).
#include "plugin_common.h"

#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <limits>

namespace dsa_trt
{

// ---------------------------------------------------------------- errors and logging
std::string strprintf(char const* fmt, ...)
{
    va_list args;
    va_start(args, fmt);
    va_list copy;
    va_copy(copy, args);
    int const n = std::vsnprintf(nullptr, 0, fmt, copy);
    va_end(copy);
    std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
    if (n > 0)
        std::vsnprintf(out.data(), out.size() + 1, fmt, args);
    va_end(args);
    return out;
}

namespace
{
std::atomic<nv::ILoggerFinder*> gLoggerFinder{nullptr};

nv::ILogger* currentLogger() noexcept
{
    if (nv::ILoggerFinder* finder = gLoggerFinder.load())
    {
        try
        {
            if (nv::ILogger* logger = finder->findLogger())
                return logger;
        }
        catch (...)
        {
        }
    }
    return ::getLogger(); // libnvinfer's global logger (set by the application's builder/runtime)
}
} // namespace

void setLoggerFinder(nv::ILoggerFinder* finder) noexcept
{
    gLoggerFinder.store(finder);
}

void logMessage(nv::ILogger::Severity severity, std::string const& msg) noexcept
{
    if (nv::ILogger* logger = currentLogger())
        logger->log(severity, msg.c_str());
    else
        std::fprintf(stderr, "[dsa_trt_plugins] %s\n", msg.c_str());
}

void logError(char const* plugin, char const* method, char const* what) noexcept
{
    try
    {
        logMessage(nv::ILogger::Severity::kERROR,
            std::string("[") + kPluginNamespace + "::" + plugin + "] " + method + ": " + what);
    }
    catch (...)
    {
        std::fprintf(stderr, "[dsa_trt_plugins] %s %s: %s\n", plugin, method, what);
    }
}

// ---------------------------------------------------------------- fields
namespace
{
bool isIgnoredField(char const* name)
{
    // Consumed by TensorRT's ONNX importer to find the creator; harmless if it passes them on.
    return std::strcmp(name, "plugin_version") == 0 || std::strcmp(name, "plugin_namespace") == 0;
}

char const* fieldTypeName(nv::PluginFieldType t)
{
    switch (t)
    {
    case nv::PluginFieldType::kFLOAT16: return "kFLOAT16";
    case nv::PluginFieldType::kFLOAT32: return "kFLOAT32";
    case nv::PluginFieldType::kFLOAT64: return "kFLOAT64";
    case nv::PluginFieldType::kINT8: return "kINT8";
    case nv::PluginFieldType::kINT16: return "kINT16";
    case nv::PluginFieldType::kINT32: return "kINT32";
    case nv::PluginFieldType::kINT64: return "kINT64";
    case nv::PluginFieldType::kCHAR: return "kCHAR";
    default: return "unsupported type";
    }
}

// Reads one scalar; ints as int64, floats as double. False if the type is not a number we accept.
bool readNumber(nv::PluginField const& f, FieldKind kind, int64_t& i, double& d)
{
    switch (f.type)
    {
    case nv::PluginFieldType::kINT8: i = *static_cast<int8_t const*>(f.data); break;
    case nv::PluginFieldType::kINT16: i = *static_cast<int16_t const*>(f.data); break;
    case nv::PluginFieldType::kINT32: i = *static_cast<int32_t const*>(f.data); break;
    case nv::PluginFieldType::kINT64: i = *static_cast<int64_t const*>(f.data); break;
    case nv::PluginFieldType::kFLOAT32:
        if (kind != FieldKind::kFloat)
            return false; // an int field delivered as float is an export bug, not a rounding question
        d = *static_cast<float const*>(f.data);
        return true;
    case nv::PluginFieldType::kFLOAT64:
        if (kind != FieldKind::kFloat)
            return false;
        d = *static_cast<double const*>(f.data);
        return true;
    default: return false;
    }
    d = static_cast<double>(i);
    return true;
}
} // namespace

FieldValues::FieldValues(
    char const* plugin, nv::PluginFieldCollection const* fc, FieldSpec const* specs, int32_t nbSpecs)
    : mPlugin(plugin)
{
    DSA_TRT_REQUIRE(fc != nullptr, "no field collection");
    DSA_TRT_REQUIRE(fc->nbFields == 0 || fc->fields != nullptr, "field collection has %d fields but no array",
        fc->nbFields);
    for (int32_t k = 0; k < fc->nbFields; ++k)
    {
        nv::PluginField const& f = fc->fields[k];
        DSA_TRT_REQUIRE(f.name != nullptr, "field %d has no name", k);
        if (isIgnoredField(f.name))
            continue;
        FieldSpec const* spec = nullptr;
        for (int32_t s = 0; s < nbSpecs; ++s)
            if (std::strcmp(specs[s].name, f.name) == 0)
                spec = &specs[s];
        DSA_TRT_REQUIRE(spec != nullptr, "unknown field '%s' (see plugins/tensorrt/PLUGINS.md)", f.name);
        for (Value const& v : mValues)
            DSA_TRT_REQUIRE(std::strcmp(v.name, f.name) != 0, "field '%s' given twice", f.name);
        DSA_TRT_REQUIRE(f.length == 1 && f.data != nullptr, "field '%s' must be one scalar, got length %d%s", f.name,
            f.length, f.data == nullptr ? " and no data" : "");
        Value v{spec->name, spec->kind, 0, 0.0};
        DSA_TRT_REQUIRE(readNumber(f, spec->kind, v.i, v.f), "field '%s' has type %s; expected %s", f.name,
            fieldTypeName(f.type),
            spec->kind == FieldKind::kInt ? "an integer (kINT32 or kINT64)" : "a float (kFLOAT32 or kFLOAT64)");
        mValues.push_back(v);
    }
    for (int32_t s = 0; s < nbSpecs; ++s)
    {
        bool found = false;
        for (Value const& v : mValues)
            found = found || std::strcmp(v.name, specs[s].name) == 0;
        DSA_TRT_REQUIRE(found, "missing field '%s'", specs[s].name);
    }
}

FieldValues::Value const& FieldValues::find(char const* name) const
{
    for (Value const& v : mValues)
        if (std::strcmp(v.name, name) == 0)
            return v;
    throw PluginError(strprintf("%s: field '%s' was not parsed", mPlugin, name));
}

int32_t FieldValues::intInRange(char const* name, int64_t lo, int64_t hi) const
{
    Value const& v = find(name);
    DSA_TRT_REQUIRE(v.kind == FieldKind::kInt, "field '%s' is not an integer field", name);
    DSA_TRT_REQUIRE(v.i >= lo && v.i <= hi, "field %s=%lld out of range [%lld, %lld]", name,
        static_cast<long long>(v.i), static_cast<long long>(lo), static_cast<long long>(hi));
    return static_cast<int32_t>(v.i);
}

float FieldValues::positiveFloat(char const* name) const
{
    Value const& v = find(name);
    DSA_TRT_REQUIRE(v.kind == FieldKind::kFloat, "field '%s' is not a float field", name);
    DSA_TRT_REQUIRE(std::isfinite(v.f) && v.f > 0.0 && v.f <= std::numeric_limits<float>::max(),
        "field %s=%g must be finite and > 0", name, v.f);
    return static_cast<float>(v.f);
}

int32_t FieldValues::cacheFormat() const
{
    return intInRange("cache_format", DSA_CACHE_FP8, DSA_CACHE_BF16);
}

void SerialFields::clear() noexcept
{
    mFields.clear();
}

void SerialFields::addInt(char const* name, int32_t const* value)
{
    mFields.emplace_back(name, value, nv::PluginFieldType::kINT32, 1);
}

void SerialFields::addFloat(char const* name, float const* value)
{
    mFields.emplace_back(name, value, nv::PluginFieldType::kFLOAT32, 1);
}

nv::PluginFieldCollection const* SerialFields::collection() noexcept
{
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
    return &mCollection;
}

// ---------------------------------------------------------------- dtypes and shapes
char const* dataTypeName(nv::DataType t) noexcept
{
    switch (t)
    {
    case nv::DataType::kFLOAT: return "FLOAT";
    case nv::DataType::kHALF: return "HALF";
    case nv::DataType::kINT8: return "INT8";
    case nv::DataType::kINT32: return "INT32";
    case nv::DataType::kBOOL: return "BOOL";
    case nv::DataType::kUINT8: return "UINT8";
    case nv::DataType::kFP8: return "FP8";
    case nv::DataType::kBF16: return "BF16";
    case nv::DataType::kINT64: return "INT64";
    default: return "other";
    }
}

std::string dimsString(nv::Dims const& d)
{
    std::string s = "[";
    for (int32_t i = 0; i < d.nbDims; ++i)
        s += (i ? ", " : "") + std::to_string(d.d[i]);
    return s + "]";
}

int64_t byteCarrierSize(nv::DataType t) noexcept
{
    switch (t)
    {
    case nv::DataType::kINT8:
    case nv::DataType::kUINT8: return 1;
    case nv::DataType::kINT32: return 4;
    default: return 0;
    }
}

bool isPoolType(int32_t cacheFormat, nv::DataType t) noexcept
{
    return cacheFormat == DSA_CACHE_FP8 ? byteCarrierSize(t) != 0 : t == nv::DataType::kBF16;
}

int64_t poolInnerExtent(int32_t cacheFormat, nv::DataType t, int64_t bytes, int64_t bf16Elems) noexcept
{
    if (cacheFormat == DSA_CACHE_BF16)
        return bf16Elems;
    int64_t const carrier = byteCarrierSize(t);
    return carrier != 0 ? bytes / carrier : -1;
}

void expectRank(nv::Dims const& d, int32_t rank, char const* tensor)
{
    DSA_TRT_REQUIRE(d.nbDims == rank, "%s must have rank %d, got %s", tensor, rank, dimsString(d).c_str());
}

void expectDim(nv::Dims const& d, int32_t i, int64_t value, char const* tensor)
{
    DSA_TRT_REQUIRE(d.d[i] < 0 || d.d[i] == value, "%s dim %d must be %lld, got %s", tensor, i,
        static_cast<long long>(value), dimsString(d).c_str());
}

void expectSameDim(nv::Dims const& a, int32_t ai, char const* ta, nv::Dims const& b, int32_t bi, char const* tb)
{
    DSA_TRT_REQUIRE(a.d[ai] < 0 || b.d[bi] < 0 || a.d[ai] == b.d[bi], "%s dim %d (%lld) must equal %s dim %d (%lld)",
        ta, ai, static_cast<long long>(a.d[ai]), tb, bi, static_cast<long long>(b.d[bi]));
}

void expectInt32(int64_t value, char const* what)
{
    DSA_TRT_REQUIRE(value <= std::numeric_limits<int32_t>::max(), "%s = %lld overflows int32", what,
        static_cast<long long>(value));
}

int64_t checkMlaPool(nv::PluginTensorDesc const& pool, int32_t cacheFormat, char const* tensor)
{
    DSA_TRT_REQUIRE(isPoolType(cacheFormat, pool.type), "%s has dtype %s; cache_format=%d needs %s", tensor,
        dataTypeName(pool.type), cacheFormat, cacheFormat == DSA_CACHE_FP8 ? "INT8, UINT8 or INT32 bytes" : "BF16");
    expectRank(pool.dims, 3, tensor);
    expectDim(pool.dims, 1, DSA_PAGE_SIZE, tensor);
    expectDim(pool.dims, 2, poolInnerExtent(cacheFormat, pool.type, DSA_MLA_DIM, DSA_MLA_DIM), tensor);
    return pool.dims.d[0];
}

int64_t checkIndexerPool(nv::PluginTensorDesc const& pool, int32_t cacheFormat, char const* tensor)
{
    DSA_TRT_REQUIRE(isPoolType(cacheFormat, pool.type), "%s has dtype %s; cache_format=%d needs %s", tensor,
        dataTypeName(pool.type), cacheFormat, cacheFormat == DSA_CACHE_FP8 ? "INT8, UINT8 or INT32 bytes" : "BF16");
    if (cacheFormat == DSA_CACHE_FP8)
    {
        expectRank(pool.dims, 2, tensor);
        expectDim(pool.dims, 1, poolInnerExtent(cacheFormat, pool.type, DSA_INDEX_PAGE_BYTES, 0), tensor);
    }
    else
    {
        expectRank(pool.dims, 3, tensor);
        expectDim(pool.dims, 1, DSA_PAGE_SIZE, tensor);
        expectDim(pool.dims, 2, DSA_INDEX_DIM, tensor);
    }
    return pool.dims.d[0];
}

void expectAliased(void const* input, void const* output, int32_t inputIndex)
{
    DSA_TRT_REQUIRE(input == output,
        "output 0 is not aliased to input %d (the pool is updated in place); build the engine with "
        "PreviewFeature::kALIASED_PLUGIN_IO_10_03 enabled",
        inputIndex);
}

} // namespace dsa_trt
